# SPDX-License-Identifier: Apache-2.0
"""Stage 1 streams: keyed by the runner's request ids, each request failing alone.

* Payloads of the delay processor (no id, no finished flag) decoded one after the other
  in one batch position, or side by side in one forward, each equal their fresh decode.
* Without runner ids a payload's own id keys its stream; without either the request
  gets a logged error, never a batch-position key.
* A terminal payload always ends its stream (malformed, short of its declared size in a
  step that left token budget unused, or the `[0]` placeholder); a chunk split by the
  token budget is buffered until its declared size; a malformed payload (a bad count
  field, a ``meta`` that is not a dict, in streaming and offline decode) fails alone; a
  chunk short of its declared size fails alone, and the stream's next chunk decodes.
* Session errors are logged once per request (a step that raises fails its own rows' requests, which return
  the audio decoded before it); audio decoded from the admission queue
  after a request's last row is logged as lost when the request finishes; what the stage
  keeps per stream ends with the stream; session statistics are logged periodically.
"""

from __future__ import annotations

import logging

import pytest
import torch
from moss_codecs import count_steps
from stage_helpers import build_stage, delay_info, error_result, fresh_decode, raw_info, run

from vllm_omni_moss.model_executor.models.moss_tts.serving.step_runner import StepPlanner

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.core_model]

STAGE_LOGGER = "vllm_omni_moss.model_executor.models.moss_tts.stage"


def _codes(stage, frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, stage._codec.config.codebook_size, (stage.n_vq, frames), generator=gen)


def _assert_audio(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert got.shape == ref.shape, what
    err = (got - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), f"{what}: max error {err}"


def _bad_row_beside_a_good_one(stage, caplog, bad_info: dict, seeds: tuple[int, int]) -> list[str]:
    """Streams g and b decode a first frame; then g's next 2 frames and b's row with payload ``bad_info`` go
    in one batch. Asserts b's row returns no audio and g's audio is exact; returns the stage's warnings."""
    good, bad = _codes(stage, 3, seed=seeds[0]), _codes(stage, 2, seed=seeds[1])
    n = stage.n_vq
    run(stage, [good[:, :1], bad[:, :1]], [raw_info("g", 1, n), raw_info("b", 1, n)], ["g", "b"])
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [good[:, 1:], bad[:, 1:]], [raw_info("g", 2, n), bad_info], ["g", "b"])
    assert out[1].numel() == 0
    _assert_audio(out[0], fresh_decode(stage, good, [1, 2])[..., -out[0].shape[-1] :], "good")
    return _warnings(caplog)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == STAGE_LOGGER and r.levelno == logging.WARNING]


# ----------------------------------------------------------------------------- keys


def test_delay_requests_in_one_batch_position_each_equal_their_fresh_decode(stage):
    a, b = _codes(stage, 5, seed=1), _codes(stage, 4, seed=2)
    got_a = [run(stage, [a[:, :2]], [delay_info()], ["A-0123abcd"])[0]]
    got_a += run(stage, [a[:, 2:]], [delay_info()], ["A-0123abcd"])
    # B takes batch position 0 while A is still live, then again after A finished.
    got_b = run(stage, [b[:, :1]], [delay_info()], ["B-4567ef01"])
    stage.on_requests_finished(["A-0123abcd"])
    got_b += run(stage, [b[:, 1:]], [delay_info()], ["B-4567ef01"])
    stage.on_requests_finished(["B-4567ef01"])
    _assert_audio(torch.cat(got_a, dim=-1), fresh_decode(stage, a, [2, 3]), "A")
    _assert_audio(torch.cat(got_b, dim=-1), fresh_decode(stage, b, [1, 3]), "B")
    assert not stage._session.live_requests and stage._session.free_slots == stage.state_capacity


def test_two_delay_payloads_in_one_forward_keep_their_streams(stage):
    x, y = _codes(stage, 6, seed=3), _codes(stage, 5, seed=4)
    got = {"x": [], "y": []}
    for order, (xs, ys) in (("xy", ((0, 2), (0, 1))), ("yx", ((2, 3), (1, 4))), ("xy", ((3, 6), (4, 5)))):
        parts = {"x": x[:, xs[0] : xs[1]], "y": y[:, ys[0] : ys[1]]}
        outs = run(stage, [parts[k] for k in order], [delay_info(), delay_info()], list(order))
        for k, wav in zip(order, outs):
            if parts[k].shape[1]:
                got[k].append(wav)
    _assert_audio(torch.cat(got["x"], dim=-1), fresh_decode(stage, x, [2, 1, 3]), "x")
    _assert_audio(torch.cat(got["y"], dim=-1), fresh_decode(stage, y, [1, 3, 1]), "y")


def test_a_stage_decodes_a_call_of_mixed_lengths_in_one_step(tmp_path, monkeypatch):
    """Every step is ragged: a forward with chunks of 3, 3 and 2 frames (beside a stream's 1-frame first chunk
    before it) is one pool step, its rows shortest first and packed (enforce_eager: shaped exactly), and every
    stream's audio equals its fresh decode."""
    stage = build_stage(tmp_path)
    codes = [_codes(stage, n, seed=10 + i) for i, n in enumerate((4, 3, 2))]
    run(stage, [codes[0][:, :1]], [delay_info()], ["a"])
    steps = count_steps(stage._session, monkeypatch)
    outs = run(stage, [codes[0][:, 1:], codes[1], codes[2]], [delay_info()] * 3, ["a", "b", "c"])
    assert steps == [(3, 3, 8)] and stage._session.stats()["padded_frames"] == 0
    _assert_audio(outs[0], fresh_decode(stage, codes[0], [1, 3])[..., -outs[0].shape[-1] :], "a")
    _assert_audio(outs[1], fresh_decode(stage, codes[1], [3]), "b")
    _assert_audio(outs[2], fresh_decode(stage, codes[2], [2]), "c")


def test_forward_runs_no_garbage_collection_and_resumes_it_after(tmp_path, monkeypatch):
    """Python's collector is off for the whole forward() (the session call and the stage's own work around it, here
    the stats log) and on again once it returns; a collector the caller turned off stays off."""
    import gc

    stage = build_stage(tmp_path)
    seen = []
    log = stage._maybe_log_stats
    monkeypatch.setattr(stage, "_maybe_log_stats", lambda: seen.append(gc.isenabled()) or log())
    codes = _codes(stage, 2, seed=3)
    assert gc.isenabled()
    run(stage, [codes[:, :1]], [delay_info()], ["a"])
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        run(stage, [codes[:, 1:]], [delay_info()], ["a"])
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()


def test_without_runner_ids_a_payload_without_id_fails_alone(stage, caplog):
    d, r = _codes(stage, 2, seed=5), _codes(stage, 2, seed=6)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [d, r], [delay_info(), raw_info("r", 2, stage.n_vq)])
    assert out[0].numel() == 0
    _assert_audio(out[1], fresh_decode(stage, r, [2]), "r")
    assert set(stage._session.live_requests) == {"r"}
    assert _warnings(caplog) == [
        "MOSS codec request None (batch row 0): no stream id: the runner passed no request_ids and the payload "
        "names no req_id; returning empty audio"
    ]


def test_payload_id_is_a_cross_check_logged_once(stage, caplog):
    c = _codes(stage, 4, seed=7)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        run(stage, [c[:, :2]], [raw_info("other", 2, stage.n_vq)], ["runner-1"])
        run(stage, [c[:, 2:]], [raw_info("other", 2, stage.n_vq)], ["runner-1"])
        run(stage, [c[:, :1]], [raw_info("same", 1, stage.n_vq)], ["same-89abcdef"])  # vLLM's suffix: no warning
    assert set(stage._session.live_requests) == {"runner-1", "same-89abcdef"}
    assert _warnings(caplog) == [
        "MOSS codec request runner-1: its payload names request other; keyed by the runner's id"
    ]


def test_a_payload_id_twice_in_one_batch_fails_the_second(stage, caplog):
    c = _codes(stage, 2, seed=8)
    info = raw_info("dup", 2, stage.n_vq)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [c, c], [info, info])
    _assert_audio(out[0], fresh_decode(stage, c, [2]), "first")
    assert out[1].numel() == 0
    assert _warnings(caplog) == [
        "MOSS codec request dup (batch row 1): request id appears twice in one batch; returning empty audio"
    ]


def test_a_terminal_row_twice_in_one_batch_still_ends_its_stream(stage, caplog):
    c = _codes(stage, 3, seed=40)
    n = stage.n_vq
    first = run(stage, [c[:, :1]], [raw_info("A", 1, n)], ["A"])
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [c[:, 1:2], c[:, 2:]], [raw_info("A", 1, n), raw_info("A", 1, n, finished=True)], ["A", "A"])
    assert out[1].numel() == 0 and not stage._session.live_requests
    assert stage._session.free_slots == stage.state_capacity
    _assert_audio(torch.cat(first + out[:1], dim=-1), fresh_decode(stage, c[:, :2], [1, 1]), "the first row")
    assert _warnings(caplog) == [
        "MOSS codec request A (batch row 1): request id appears twice in one batch; returning empty audio"
    ]


@pytest.mark.parametrize("ids", [[1, "1"], [None, None], ["", "x"]], ids=["int-and-str", "none", "empty"])
def test_a_runner_id_that_is_not_a_non_empty_str_fails_its_row_alone(stage, caplog, ids):
    a, b = _codes(stage, 2, seed=41), _codes(stage, 2, seed=42)
    n = stage.n_vq
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [a, b], [raw_info("p", 2, n), raw_info("q", 2, n)], ids)
    good = {i: rid for i, rid in enumerate(ids) if isinstance(rid, str) and rid}
    assert {i for i, wav in enumerate(out) if wav.numel()} == set(good)
    for i in good:
        _assert_audio(out[i], fresh_decode(stage, (a, b)[i], [2]), f"row {i}")
    assert set(stage._session.live_requests if stage._session else ()) == set(good.values())
    assert [m.split(": ", 1)[1] for m in _warnings(caplog) if "request id must" in m] == [
        f"the runner's request id must be a non-empty str, got {rid!r}; returning empty audio"
        for i, rid in enumerate(ids)
        if i not in good
    ]


def test_finishing_a_single_string_id_is_refused(stage):
    n = stage.n_vq
    run(stage, [_codes(stage, 1, 43), _codes(stage, 1, 44)], [raw_info("ab", 1, n), raw_info("a", 1, n)], ["ab", "a"])
    with pytest.raises(TypeError, match="got the single id 'ab'"):
        stage.on_requests_finished("ab")
    with pytest.raises(TypeError, match=r"^finished_req_ids must be a collection of request ids, got None$"):
        stage.on_requests_finished(None)
    with pytest.raises(TypeError, match=r"^finished_req_ids must hold str request ids, got b'a'$"):
        stage.on_requests_finished(["ab", b"a"])  # nothing is finished: the ids are checked first
    assert set(stage._session.live_requests) == {"ab", "a"}


@pytest.mark.parametrize("counts", [[11.9], ["11"], [11, float("nan")], [True]])
def test_seq_token_counts_must_be_integers(stage, counts):
    with pytest.raises(ValueError, match=r"seq_token_counts must hold integers >= 0, got "):
        stage(
            input_ids=torch.zeros(30, dtype=torch.long),
            positions=None,
            runtime_additional_information=[raw_info("x", 1, stage.n_vq)] * len(counts),
            seq_token_counts=counts,
            request_ids=[f"x{i}" for i in range(len(counts))],
        )
    assert not stage._session or not stage._session.live_requests


# ----------------------------------------------------------------------------- malformed and split payloads


def test_malformed_terminal_payload_fails_alone_and_frees_its_slot(stage, caplog):
    good, bad, again = _codes(stage, 3, seed=9), _codes(stage, 1, seed=10), _codes(stage, 2, seed=11)
    run(stage, [good[:, :1], bad], [raw_info("g", 1, stage.n_vq), raw_info("b", 1, stage.n_vq)], ["g", "b"])
    terminal = {"meta": {"stream_finished": torch.tensor(True)}}  # no declared size
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [good[:, 1:], torch.arange(23)], [raw_info("g", 2, stage.n_vq), terminal], ["g", "b"])
    assert out[1].numel() == 0
    _assert_audio(out[0], fresh_decode(stage, good, [1, 2])[..., -out[0].shape[-1] :], "good")
    assert set(stage._session.live_requests) == {"g"} and stage._session.free_slots == stage.state_capacity - 1
    assert _warnings(caplog) == [
        f"MOSS codec request b (batch row 1): 23 codes are not a multiple of n_vq={stage.n_vq}; returning empty audio"
    ]
    # The id starts a fresh stream afterwards.
    _assert_audio(run(stage, [again], [raw_info("b", 2, stage.n_vq)], ["b"])[0], fresh_decode(stage, again, [2]), "b")


@pytest.mark.parametrize("declared", [True, False], ids=["raw-placeholder", "undeclared"])
def test_segment_end_placeholder_ends_the_stream(stage, declared):
    first, second = _codes(stage, 2, seed=12), _codes(stage, 3, seed=13)
    info = raw_info("r", 2, stage.n_vq)
    run(stage, [first], [info], ["r-1"])
    if declared:  # codec_chunk_frames=0; code_flat_numel is the previous chunk's
        end = raw_info("r", 0, stage.n_vq, finished=True, segment_end=True, previous=info)
        assert end["meta"]["code_flat_numel"] == 2 * stage.n_vq
    else:
        end = {"meta": {"stream_finished": torch.tensor(True)}}
    out = run(stage, [torch.zeros(1)], [end], ["r-1"])
    assert out[0].numel() == 0
    assert not stage._session.live_requests and stage._session.free_slots == stage.state_capacity
    got = run(stage, [second], [raw_info("r", 3, stage.n_vq, previous=end)], ["r-1"])[0]
    _assert_audio(got, fresh_decode(stage, second, [3]), "next segment")


def test_split_chunk_is_buffered_until_its_declared_size(stage, caplog):
    codes = _codes(stage, 5, seed=14)
    head, tail = codes[:, :2], codes[:, 2:].reshape(-1)
    got = run(stage, [head], [raw_info("s", 2, stage.n_vq)], ["s"])
    # A terminal 3-frame chunk split by the token budget: both parts carry its meta.
    terminal = raw_info("s", 3, stage.n_vq, finished=True)
    stage.token_budget = 7  # the first part used the whole budget of its step
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        part = run(stage, [tail[:7]], [terminal], ["s"])
        assert part[0].numel() == 0 and set(stage._session.live_requests) == {"s"}
        got += run(stage, [tail[7:]], [terminal], ["s"])
    assert not _warnings(caplog)
    assert not stage._session.live_requests
    _assert_audio(torch.cat(got, dim=-1), fresh_decode(stage, codes, [2, 3]), "split")


def test_a_terminal_chunk_split_after_its_first_token_is_not_a_placeholder(stage, caplog):
    # A 1-frame terminal chunk whose first token ends a step that used the whole budget: that single token is the
    # chunk's first, not the connector's `[0]` placeholder; the rest completes it in the next step.
    c = _codes(stage, 2, seed=45)
    n = stage.n_vq
    info = raw_info("A", 1, n)
    got = run(stage, [c[:, :1]], [info], ["A"])
    terminal = raw_info("A", 1, n, finished=True, previous=info)
    stage.token_budget = 1
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        part = run(stage, [c[:, 1].reshape(-1)[:1]], [terminal], ["A"])
        assert part[0].numel() == 0 and set(stage._session.live_requests) == {"A"}
        stage.token_budget = None
        got += run(stage, [c[:, 1].reshape(-1)[1:]], [terminal], ["A"])
    assert not _warnings(caplog) and not stage._session.live_requests
    _assert_audio(torch.cat(got, dim=-1), fresh_decode(stage, c, [1, 1]), "A")


@pytest.mark.parametrize("budget", [None, 1000], ids=["no-budget", "budget-unused"])
def test_short_terminal_payload_ends_its_stream_when_no_rest_can_follow(stage, caplog, budget):
    first, short, again = _codes(stage, 1, seed=30), _codes(stage, 2, seed=31), _codes(stage, 2, seed=32)
    n = stage.n_vq
    stage.token_budget = budget
    info = raw_info("x", 1, n)
    run(stage, [first], [info], ["x"])
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [short], [raw_info("x", 5, n, finished=True, previous=info)], ["x"])
    assert out[0].numel() == 0
    assert not stage._payloads.partial and not stage._session.live_requests
    assert stage._session.free_slots == stage.state_capacity
    assert _warnings(caplog) == [
        f"MOSS codec request x (batch row 0): the terminal payload declares {5 * n} codes but {2 * n} arrived in "
        "a step that left token budget unused (not a split chunk); the incomplete chunk is dropped; "
        "returning empty audio"
    ]
    _assert_audio(run(stage, [again], [raw_info("x", 2, n)], ["x"])[0], fresh_decode(stage, again, [2]), "next")


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("codec_chunk_frames", "abc", "'abc'"),
        ("codec_chunk_frames", float("nan"), "nan"),
        ("codec_chunk_frames", float("inf"), "inf"),
        ("codec_chunk_frames", -2, "-2"),
        ("codec_chunk_frames", [1.5], "[1.5]"),
        ("code_flat_numel", torch.tensor([22.5]), "tensor([22.5000])"),
        ("code_flat_numel", True, "True"),
    ],
)
def test_a_bad_count_field_fails_alone_and_a_terminal_one_frees_its_slot(stage, caplog, field, value, shown):
    meta = {"stream_finished": torch.tensor(True), field: value}
    warnings = _bad_row_beside_a_good_one(stage, caplog, {"meta": meta}, seeds=(33, 34))
    assert set(stage._session.live_requests) == {"g"} and stage._session.free_slots == stage.state_capacity - 1
    assert warnings == [
        f"MOSS codec request b (batch row 1): payload meta.{field} must be an integer >= 0, got {shown}; "
        "returning empty audio"
    ]


@pytest.mark.parametrize("value", ["false", "0", 2, float("nan"), torch.tensor(0.5)])
def test_a_terminal_flag_that_is_not_a_bool_fails_alone(stage, caplog, value):
    # Read as truthy, "false" would end a stream its sender did not end; the row fails and the stream stays.
    meta = {**raw_info("b", 1, stage.n_vq)["meta"], "stream_finished": value}
    warnings = _bad_row_beside_a_good_one(stage, caplog, {"meta": meta}, seeds=(37, 38))
    assert set(stage._session.live_requests) == {"g", "b"}
    assert warnings == [
        f"MOSS codec request b (batch row 1): payload meta.stream_finished must be a bool, got {value!r}; "
        "returning empty audio"
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_a_terminal_row_of_non_integer_ids_still_ends_its_stream(stage, caplog, dtype):
    codes = _codes(stage, 2, seed=39)
    n = stage.n_vq
    info = raw_info("b", 1, n)
    run(stage, [codes[:, :1]], [info], ["b"])
    terminal = raw_info("b", 1, n, finished=True, previous=info)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = stage(
            input_ids=codes[:, 1:].reshape(-1).to(dtype),
            positions=None,
            runtime_additional_information=[terminal],
            seq_token_counts=[n],
            request_ids=["b"],
        ).multimodal_outputs["model_outputs"]
    assert out[0].numel() == 0
    assert not stage._session.live_requests and stage._session.free_slots == stage.state_capacity
    assert _warnings(caplog) == [
        f"MOSS codec request b (batch row 0): input_ids must be integer codes, got dtype {dtype}; returning empty audio"
    ]


@pytest.mark.parametrize("meta", [["x"], "oops"], ids=["list", "str"])
def test_a_meta_that_is_not_a_dict_fails_alone(stage, caplog, meta):
    warnings = _bad_row_beside_a_good_one(stage, caplog, {"meta": meta}, seeds=(35, 36))
    # No terminal flag can be read: b's stream is left as it was, until the runner ends it.
    assert set(stage._session.live_requests) == {"g", "b"}
    assert warnings == [
        f"MOSS codec request b (batch row 1): payload meta must be a dict, got {type(meta).__name__}; "
        "returning empty audio"
    ]
    stage.on_requests_finished(["b"])
    assert set(stage._session.live_requests) == {"g"}


@pytest.mark.parametrize(
    ("info", "error"),
    [
        ({"meta": {"left_context_size": "abc"}}, "payload meta.left_context_size must be an integer >= 0, got 'abc'"),
        (
            {"meta": {"left_context_size": float("nan")}},
            "payload meta.left_context_size must be an integer >= 0, got nan",
        ),
        ({"meta": {"left_context_size": -5}}, "payload meta.left_context_size must be an integer >= 0, got -5"),
        ({"meta": [1]}, "payload meta must be a dict, got list"),
        # Upstream trims it all away too; here the request's error says why its audio is empty.
        ({"meta": {"left_context_size": 3}}, "left_context_size 3 is not below the request's 3 frames"),
    ],
)
def test_offline_decode_fails_a_bad_payload_alone(tmp_path, caplog, info, error):
    stage = build_stage(tmp_path, async_chunk=False)
    codes = _codes(stage, 3, seed=37)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [codes, codes], [{"meta": {"left_context_size": 1}}, info], ["good", "bad"])
    assert out[1].numel() == 0
    spf = stage._codec.config.samples_per_frame
    ref = stage._codec.decode(codes[:, None])[0][..., spf:]  # whole utterance, minus 1 frame of left context
    _assert_audio(out[0], ref.reshape(-1) if ref.shape[0] == 1 else ref, "good")
    assert _warnings(caplog) == [f"MOSS codec request None (batch row 1): {error}; returning empty audio"]


@pytest.mark.parametrize("value", ["-7", "K+5", "2**62"])
def test_codes_outside_the_codebook_fail_their_chunk_alone_and_the_stream_goes_on(stage, caplog, value):
    K, n = stage._codec.config.codebook_size, stage.n_vq
    v = {"-7": -7, "K+5": K + 5, "2**62": 2**62}[value]
    good, a, bad, c = (_codes(stage, f, seed=40 + i) for i, f in enumerate((3, 2, 2, 2)))
    bad[n - 1, 1] = v
    run(stage, [good[:, :1], a], [raw_info("g", 1, n), raw_info("s", 2, n)], ["g", "s"])
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [good[:, 1:], bad], [raw_info("g", 2, n), raw_info("s", 2, n)], ["g", "s"])
    assert out[1].numel() == 0
    _assert_audio(out[0], fresh_decode(stage, good, [1, 2])[..., -out[0].shape[-1] :], "good")
    got = run(stage, [c], [raw_info("s", 2, n, finished=True)], ["s"])[0]  # decodes as if bad never came
    _assert_audio(got, fresh_decode(stage, torch.cat([a, c], dim=1), [2, 2])[..., -got.shape[-1] :], "s")
    assert _warnings(caplog) == [
        f"MOSS codec request s (batch row 1): code {v} is outside 0..{K} (codebook_size {K}, the last the "
        "talker's padding); the chunk is refused; returning empty audio"
    ]


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_codes_wider_than_a_byte_fail_each_row_with_an_error_naming_the_dtype(stage, caplog, dtype):
    # The engine's input_ids is one tensor: every row of such a batch has its dtype. The batch's range check takes
    # the session's code dtypes only (aminmax takes no uint16-64), so each row gets the session's error and the
    # stage goes on: the next batch decodes.
    n = stage.n_vq
    good, bad = _codes(stage, 2, seed=46), _codes(stage, 2, seed=47)
    ids = torch.cat([good.reshape(-1), bad.reshape(-1)]).to(dtype)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = stage(
            input_ids=ids, positions=None, runtime_additional_information=[raw_info("g", 2, n), raw_info("u", 2, n)],
            seq_token_counts=[2 * n, 2 * n], request_ids=["g", "u"],
        ).multimodal_outputs["model_outputs"]  # fmt: skip
    assert [o.numel() for o in out] == [0, 0] and stage._session.live_requests == {}
    assert _warnings(caplog) == [
        f"MOSS codec request {rid} (batch row {i}): request {rid!r}: codes must be signed integers (or uint8), got "
        f"{dtype}; returning empty audio"
        for i, rid in enumerate(("g", "u"))
    ]
    got = run(stage, [good], [raw_info("g2", 2, n)], ["g2"])[0]
    _assert_audio(got, fresh_decode(stage, good, [2]), "next batch")


def test_a_terminal_chunk_with_codes_outside_the_codebook_still_ends_its_stream(stage, caplog):
    n = stage.n_vq
    bad = _codes(stage, 2, seed=44)
    bad[0, 0] = -1
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [bad], [raw_info("s", 2, n, finished=True)], ["s"])
    assert out[0].numel() == 0 and stage._session.free_slots == stage.state_capacity
    assert len(_warnings(caplog)) == 1


def test_the_talkers_padding_code_decodes_as_upstreams_clamp(stage):
    """``codebook_size`` is the talker's padding code: decoded as ``codebook_size - 1``, as upstream does."""
    K, n = stage._codec.config.codebook_size, stage.n_vq
    codes = _codes(stage, 3, seed=45)
    codes[:, 2] = K
    got = run(stage, [codes], [raw_info("s", 3, n)], ["s"])[0]
    _assert_audio(got, fresh_decode(stage, codes, [3]), "padding")


def test_offline_decode_refuses_codes_outside_the_codebook(tmp_path, caplog):
    stage = build_stage(tmp_path, async_chunk=False)
    K = stage._codec.config.codebook_size
    codes = _codes(stage, 3, seed=46)
    bad = codes.clone()
    bad[1, 2] = K + 1
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [codes, bad], [{"meta": {"left_context_size": 0}}] * 2, ["good", "bad"])
    assert out[1].numel() == 0
    ref = stage._codec.decode(codes[:, None])[0]  # the whole utterance at once
    _assert_audio(out[0], ref.reshape(-1) if ref.shape[0] == 1 else ref, "good")
    assert _warnings(caplog) == [
        f"MOSS codec request None (batch row 1): code {K + 1} is outside 0..{K} (codebook_size {K}, the last the "
        "talker's padding); the chunk is refused; returning empty audio"
    ]


def test_finished_request_drops_its_buffered_prefix(stage):
    codes = _codes(stage, 2, seed=15)
    stage.token_budget = 5  # the prefix used the whole budget of its step
    run(stage, [codes.reshape(-1)[:5]], [raw_info("s", 2, stage.n_vq)], ["s"])
    assert set(stage._payloads.partial) == {"s"}
    stage.on_requests_finished(["s"])
    got = run(stage, [codes], [raw_info("s", 2, stage.n_vq)], ["s"])[0]
    _assert_audio(got, fresh_decode(stage, codes, [2]), "after abort")


def test_chunk_longer_than_declared_fails_alone_and_leaves_the_stream(stage, caplog):
    a, bad, c = _codes(stage, 2, seed=16), _codes(stage, 3, seed=17), _codes(stage, 2, seed=18)
    n = stage.n_vq
    got = run(stage, [a], [raw_info("s", 2, n)], ["s"])
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [bad], [raw_info("s", 2, n)], ["s"])
    assert out[0].numel() == 0
    got += run(stage, [c], [raw_info("s", 2, n)], ["s"])
    _assert_audio(torch.cat(got, dim=-1), fresh_decode(stage, torch.cat([a, c], dim=1), [2, 2]), "s")
    assert _warnings(caplog) == [
        f"MOSS codec request s (batch row 0): {3 * n} codes exceed the {2 * n} the payload declares; "
        "returning empty audio"
    ]


def test_a_short_chunk_in_a_step_with_budget_to_spare_fails_alone_and_the_next_chunk_decodes(stage, caplog):
    """A chunk one codebook short of its declared size, in a step that left token budget unused, cannot be a
    split chunk: it fails alone, by its own row, and the stream's next, well-formed chunk decodes (before, the
    short chunk was kept as a split prefix, the next chunk joined to it and both were refused, the error naming
    the good chunk)."""
    a, bad, c = _codes(stage, 2, seed=50), _codes(stage, 2, seed=51), _codes(stage, 2, seed=52)
    n = stage.n_vq
    stage.token_budget = 1000
    got = run(stage, [a], [raw_info("s", 2, n)], ["s"])
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [bad[1:]], [raw_info("s", 2, n)], ["s"])  # codebook 0 missing: 2 codes short
        assert out[0].numel() == 0 and not stage._payloads.partial
        got += run(stage, [c], [raw_info("s", 2, n)], ["s"])
    _assert_audio(torch.cat(got, dim=-1), fresh_decode(stage, torch.cat([a, c], dim=1), [2, 2]), "s")
    assert _warnings(caplog) == [
        f"MOSS codec request s (batch row 0): the payload declares {2 * n} codes but {2 * n - 2} arrived in a "
        "step that left token budget unused (not a split chunk); the incomplete chunk is dropped; "
        "returning empty audio"
    ]


@pytest.mark.parametrize("next_frames", [2, 3, 0], ids=["same-size", "other-size", "terminal-placeholder"])
def test_a_short_chunk_taken_for_a_split_fails_alone_when_the_next_chunk_comes(stage, caplog, next_frames):
    """A short chunk in a step that used the whole token budget is buffered as the first part of a split chunk;
    a next row that does not fit its declared size (more codes, or another declared size) is the stream's next
    chunk: the short one is dropped with an error naming it, and the next one decodes (or ends the stream)."""
    a, bad, c = _codes(stage, 2, seed=53), _codes(stage, 2, seed=54), _codes(stage, max(next_frames, 1), seed=55)
    n = stage.n_vq
    got = run(stage, [a], [raw_info("s", 2, n)], ["s"])
    stage.token_budget = 2 * n - 2  # the short chunk used the whole budget of its step
    info = raw_info("s", 2, n, previous=raw_info("s", 2, n))
    assert run(stage, [bad[1:]], [info], ["s"])[0].numel() == 0 and set(stage._payloads.partial) == {"s"}
    stage.token_budget = 1000
    last = next_frames == 0
    seg = torch.zeros(1, dtype=torch.long) if last else c
    nxt = raw_info("s", next_frames, n, finished=last, segment_end=last, previous=info)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        got += run(stage, [seg], [nxt], ["s"])
    decoded = a if last else torch.cat([a, c], dim=1)
    _assert_audio(torch.cat(got, dim=-1), fresh_decode(stage, decoded, [2] if last else [2, next_frames]), "s")
    assert not stage._payloads.partial and set(stage._session.live_requests) == (set() if last else {"s"})
    assert _warnings(caplog) == [
        f"MOSS codec request s (batch row 0): the stream's previous chunk declares {2 * n} codes but only "
        f"{2 * n - 2} arrived before its next chunk (a short chunk, not a split one); it is dropped; "
        "this row decodes"
    ]


# ----------------------------------------------------------------------------- session results


def test_session_error_is_logged_once_and_empties_only_that_request(stage, caplog, monkeypatch):
    session = stage._ensure_session()
    decode = session.decode

    def failing(requests):
        results = decode(requests)
        return {k: error_result(r, "boom") if k == "bad" else r for k, r in results.items()}

    monkeypatch.setattr(session, "decode", failing)
    good, bad = _codes(stage, 3, seed=19), _codes(stage, 3, seed=20)
    got = []
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        for sl in (slice(0, 1), slice(1, 3)):
            out = run(stage, [good[:, sl], bad[:, sl]], [delay_info(), delay_info()], ["good", "bad"])
            assert out[1].numel() == 0
            got.append(out[0])
    _assert_audio(torch.cat(got, dim=-1), fresh_decode(stage, good, [1, 2]), "good")
    assert _warnings(caplog) == ["MOSS codec request bad (batch row 1): boom; returning empty audio"]


def test_audio_of_a_stream_outside_the_batch_comes_with_its_next_row(stage, caplog, monkeypatch):
    session = stage._ensure_session()
    decode = session.decode
    ch, spf = stage._channels, stage._codec.config.samples_per_frame
    held = torch.full((ch, spf), 0.5)
    calls = []

    def with_queued(requests):
        results = decode(requests)
        first = results[requests[0].request_id]
        if not calls:  # the first call also decoded one frame of "q", waiting in the admission queue
            results["q"] = type(first)(held, first.sample_rate, 1)
            results["z"] = error_result(first, "queue full")
        calls.append(len(requests))
        return results

    monkeypatch.setattr(session, "decode", with_queued)
    p, q = _codes(stage, 1, seed=21), _codes(stage, 2, seed=22)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        run(stage, [p], [delay_info()], ["p"])
    assert _warnings(caplog) == ["MOSS codec request z (not in this batch): queue full; returning empty audio"]
    got = run(stage, [q], [delay_info()], ["q"])[0]
    ref = fresh_decode(stage, q, [2])
    assert got.shape[-1] == ref.shape[-1] + spf
    assert torch.equal(got[..., :spf], held.reshape(got[..., :spf].shape))
    _assert_audio(got[..., spf:], ref, "q")


def test_a_failing_step_returns_the_audio_decoded_before_it_and_fails_only_its_request(stage, caplog, monkeypatch):
    """Request f's 5-frame chunk is cut into 3 + 2 frames; the step of its second piece (round 1, f alone) raises:
    its row returns the 3 frames decoded before in round 0's step beside g's frame (the error logged once),
    request g's row is exact, and f's next row returns empty audio while g decodes on."""
    session = stage._ensure_session()
    real, tried = session.step_runner.eager_step, []

    def step(codes, lengths, slot_ids, valid, frames):
        tried.append((lengths.shape[0], frames, codes.shape[1]))
        if len(tried) == 2:  # 1: g's frame and f's first piece, 2: f's second piece
            raise RuntimeError("injected")
        return real(codes, lengths, slot_ids, valid, frames)

    monkeypatch.setattr(session.step_runner, "eager_step", step)
    g, f = _codes(stage, 2, seed=31), _codes(stage, 6, seed=32)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [g[:, :1], f[:, :5]], [delay_info(), delay_info()], ["g", "f"])
        assert tried == [(2, 3, 4), (1, 2, 2)]  # (rows, T, packed frames)
        _assert_audio(out[0], fresh_decode(stage, g[:, :1], [1]), "g")
        _assert_audio(out[1], fresh_decode(stage, f[:, :3], [3]), "f: the piece decoded before the failure")
        later = run(stage, [g[:, 1:], f[:, 5:]], [delay_info(), delay_info()], ["g", "f"])
    assert later[1].numel() == 0
    _assert_audio(later[0], fresh_decode(stage, g, [1, 1])[..., -later[0].shape[-1] :], "g after")
    assert _warnings(caplog) == [
        "MOSS codec request f (batch row 1): request 'f': its decoder step (1 rows x 2 frames) failed with "
        "RuntimeError: injected; the stream was ended, frames left undecoded: 2; returning the 3 frames decoded "
        "before it"
    ]
    assert set(session.live_requests) == {"g"}


def test_a_session_call_that_raises_fails_its_rows_alone_and_forward_returns(stage, caplog, monkeypatch):
    """The session's call raises past its checks (its step planner, here): forward returns, each row of the batch
    returns empty audio with its error logged once, the session ended their streams (a later row of one returns
    empty audio), and a new stream decodes exactly in the next forward. A call that the session refuses before
    it changes anything (a closed session: a programming error, no request's) still raises from forward."""
    session = stage._ensure_session()
    g, f, h = (_codes(stage, 2, seed=seed) for seed in (41, 42, 43))
    run(stage, [g[:, :1]], [delay_info()], ["g"])

    def broken(planner, round_pieces):
        raise RuntimeError("injected planner failure")

    monkeypatch.setattr(StepPlanner, "plan_round", broken)
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        out = run(stage, [g[:, 1:], f[:, :1]], [delay_info(), delay_info()], ["g", "f"])
    monkeypatch.undo()
    assert [o.numel() for o in out] == [0, 0]
    assert _warnings(caplog) == [
        f"MOSS codec request {rid} (batch row {i}): request {rid!r}: its decode call failed with RuntimeError: "
        "injected planner failure; the stream was ended; returning empty audio"
        for i, rid in enumerate("gf")
    ]
    assert session.live_requests == {}
    later = run(stage, [f[:, 1:], h], [delay_info(), delay_info()], ["f", "h"])
    assert later[0].numel() == 0
    _assert_audio(later[1], fresh_decode(stage, h, [2]), "h")
    session.close()
    with pytest.raises(RuntimeError, match="^this CodecStreamSession is closed$"):
        run(stage, [h], [delay_info()], ["h2"])


def test_bookkeeping_of_ended_streams_does_not_grow_without_on_requests_finished(stage, caplog):
    """A caller that drives the stage without vLLM-Omni's runner never calls ``on_requests_finished``: what the
    stage keeps per stream (the warnings it logged once) is dropped when the stream's terminal chunk ends it."""
    n = stage.n_vq
    with caplog.at_level(logging.WARNING, logger=STAGE_LOGGER):
        for i in range(50):
            c = _codes(stage, 2, seed=40 + i)
            run(stage, [c[:, :1]], [raw_info(f"other-{i}", 1, n)], [f"r{i}"])  # its payload names another id
            run(stage, [c[:, 1:]], [raw_info(f"other-{i}", 1, n, finished=True)], [f"r{i}"])
    assert len(_warnings(caplog)) == 50  # one mismatch warning per stream
    assert stage._mismatch_warned == set() and stage._reported == set()
    assert not stage._session.live_requests and not stage._held and not stage._payloads.partial


def test_a_terminal_chunk_of_a_waiting_stream_is_decoded_in_its_step(tmp_path, caplog):
    """More streams than slots (the runner finishes a request right after its terminal step): the stream whose
    terminal chunk arrives while it waits is admitted at once, the live stream preempted to make room, and every
    frame of both comes back exact (before, the waiting stream's audio was held past its last row and lost)."""
    stage = build_stage(tmp_path, max_num_seqs=1)
    n = stage.n_vq
    a, q = _codes(stage, 4, seed=38), _codes(stage, 4, seed=39)
    ia, iq = raw_info("a", 1, n), raw_info("q", 1, n)
    got_a = run(stage, [a[:, :1]], [ia], ["a"])
    assert run(stage, [q[:, :1]], [iq], ["q"])[0].numel() == 0  # no free slot: q waits in the queue
    with caplog.at_level(logging.ERROR, logger=STAGE_LOGGER):
        got_q = run(stage, [q[:, 1:]], [raw_info("q", 3, n, finished=True, previous=iq)], ["q"])
        stage.on_requests_finished(["q"])
        got_a += run(stage, [a[:, 1:]], [raw_info("a", 3, n, finished=True, previous=ia)], ["a"])
        stage.on_requests_finished(["a"])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    _assert_audio(got_q[0], fresh_decode(stage, q, [1, 3]), "q, decoded in its terminal step")
    _assert_audio(torch.cat(got_a, dim=-1), fresh_decode(stage, a, [1, 3]), "a, preempted and restored")
    assert stage._session.stats()["preemptions"] == 1 and not stage._held
    assert stage._session.free_slots == 1 and not stage._session.waiting_requests


def _forward_from_buffer(stage, buffer, segments, infos, ids):
    """One forward the way vLLM's runner calls it: ``input_ids`` is a slice of one persistent buffer, which the
    runner rewrites in place before its next step."""
    flat = [s.reshape(-1).long() for s in segments]
    counts = [f.numel() for f in flat]
    buffer[: sum(counts)] = torch.cat(flat) if flat else buffer[:0]
    out = stage(
        input_ids=buffer[: sum(counts)], positions=None, runtime_additional_information=infos,
        seq_token_counts=counts, request_ids=list(ids),
    )  # fmt: skip
    buffer.fill_(stage._codec.config.codebook_size - 1)  # the next step's inputs overwrite the buffer
    return out.multimodal_outputs["model_outputs"]


def test_a_split_chunk_survives_the_runner_rewriting_its_input_buffer(stage):
    """The first part of a chunk split by the token budget is a view of the runner's input buffer: the stage
    keeps a copy (before, the buffer's next contents replaced the prefix and the audio came out wrong)."""
    buffer = torch.zeros(4096, dtype=torch.long)
    codes = _codes(stage, 5, seed=14)
    head, tail = codes[:, :2], codes[:, 2:].reshape(-1)
    got = _forward_from_buffer(stage, buffer, [head], [raw_info("s", 2, stage.n_vq)], ["s"])
    terminal = raw_info("s", 3, stage.n_vq, finished=True)
    stage.token_budget = 7  # the first part used the whole budget of its step
    assert _forward_from_buffer(stage, buffer, [tail[:7]], [terminal], ["s"])[0].numel() == 0
    got += _forward_from_buffer(stage, buffer, [tail[7:]], [terminal], ["s"])
    _assert_audio(torch.cat(got, dim=-1), fresh_decode(stage, codes, [2, 3]), "split, from a reused buffer")


@pytest.mark.slow  # long scenario: the main CPU lane runs it, the fork lane does not
@pytest.mark.parametrize("seed", [1, 2])  # two traces that lost whole requests before the fix
def test_no_request_loses_audio_when_pages_are_short(tmp_path, seed):
    """A paged pool of about two streams under eight concurrent requests, driven as vLLM's runner drives the
    stage (one persistent input buffer, ``on_requests_finished`` right after a request's terminal step): every
    request gets every frame it sent, exact."""
    stage = build_stage(tmp_path, max_num_seqs=8, codec_state_budget_gib=1e-4)
    rng = torch.Generator().manual_seed(seed)
    lengths = [int(x) for x in torch.randint(3, 13, (8,), generator=rng)]
    codes = [_codes(stage, n, seed=100 * seed + r) for r, n in enumerate(lengths)]
    spans = [[(0, 1)] + [(a, min(a + 3, n)) for a in range(1, n, 3)] for n in lengths]
    starts, step, buffer = [r % 3 for r in range(8)], 0, torch.zeros(4096, dtype=torch.long)
    audio: dict[str, list[torch.Tensor]] = {f"r{r}": [] for r in range(8)}
    sent = [0] * 8
    while any(sent[r] < len(spans[r]) for r in range(8)):
        rows = [r for r in range(8) if starts[r] <= step and sent[r] < len(spans[r])]
        infos, segs = [], []
        for r in rows:
            a, b = spans[r][sent[r]]
            sent[r] += 1
            segs.append(codes[r][:, a:b])
            infos.append(raw_info(f"r{r}", b - a, stage.n_vq, finished=sent[r] == len(spans[r])))
        out = _forward_from_buffer(stage, buffer, segs, infos, [f"r{r}" for r in rows]) if rows else []
        for r, wav in zip(rows, out):
            audio[f"r{r}"].append(wav)
        stage.on_requests_finished([f"r{r}" for r in rows if sent[r] == len(spans[r])])
        step += 1
    for r in range(8):
        got = torch.cat(audio[f"r{r}"], dim=-1)
        _assert_audio(got, fresh_decode(stage, codes[r], [1, 3]), f"request r{r} of seed {seed}")
    assert not stage._session.live_requests and not stage._session.waiting_requests


def test_session_stats_are_logged_every_interval(stage, caplog):
    c = _codes(stage, 2, seed=23)
    stage.stats_interval_s = 0.0
    with caplog.at_level(logging.INFO, logger=STAGE_LOGGER):
        run(stage, [c[:, :1]], [delay_info()], ["a"])
        s = stage._session.stats()  # what the forward above logged
        stage.stats_interval_s = 3600.0
        run(stage, [c[:, 1:]], [delay_info()], ["a"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("MOSS codec stage:")]
    assert s["decoded_frames"] == 1 and stage._session.stats()["decoded_frames"] == 2
    assert lines == [
        f"MOSS codec stage: steps graph={s['steps_by_path']['graph']} eager={s['steps_by_path']['eager']}; "
        f"frames decoded=1 padded={s['padded_frames']}; padding rows={s['padding_rows']}; waiting streams=0 "
        f"(0 frames), admitted from queue=0, longest queue wait 0.000 s; clamped codes=0, request errors=0"
    ]
