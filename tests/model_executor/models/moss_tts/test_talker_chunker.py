# SPDX-License-Identifier: Apache-2.0
"""Stage 0's ramp chunker (``talker_chunker.py``) and the one chunk schedule both stages read (needs vllm +
vllm-omni; CPU is enough).

* Without a ramp its payloads equal vLLM-Omni 0.30.0's ``talker2codec_raw_async_chunk`` for the same frames.
* With ``codec_chunk_ramp`` chunk ``i`` has ``ramp_chunk_size(i, ramp, steady)`` frames; the core's
  ``chunk_schedule`` / ``chunk_frames_at`` (what the benchmarks read) agree with vLLM-Omni's helpers.
* Stage 1 captures a graph for every size the chunker sends, including the settings vLLM-Omni's talker reads as
  15-frame steady chunks.
* A talker-like driver feeds frames through the chunker into the stage: the audio equals the codec's decode.
* Frames of the wrong dtype or width fail that request alone, naming it.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from stage_helpers import build_stage, fresh_decode, run

pytestmark = [pytest.mark.vllm, pytest.mark.cpu, pytest.mark.core_model]

N_VQ = 4
PAD = 1024
RAMPS = [[1, 1, 2, 4, 6], [1, 4, 15], [3, 5], [2, 2], [6, 1, 9]]


def _manager(extra: dict):
    """What the chunkers read and write of vLLM-Omni's chunk transfer adapter."""
    manager = SimpleNamespace(
        connector=SimpleNamespace(config={"extra": dict(extra)}),
        code_prompt_token_ids=defaultdict(list),
        request_payload={},
        put_req_chunk=defaultdict(int),
        failures={},
    )
    manager.record_send_failure = lambda rid, reason: manager.failures.setdefault(rid, reason)
    return manager


def _call(fn, manager, rid: str, frames: torch.Tensor | None, finished: bool = False):
    request = SimpleNamespace(external_req_id=rid, request_id=f"{rid}-internal")
    out = fn(manager, None if frames is None else {"codes": {"audio": frames}}, request, is_finished=finished)
    if out is not None:
        manager.put_req_chunk[rid] += 1  # the adapter counts every put
    return out


def _plain(payload) -> dict | None:
    """A payload as comparable values: tensors as lists, absent fields left out."""
    if payload is None:
        return None
    # msgspec comes with vLLM: imported here, so that the plain install (no vLLM lane) collects this module and
    # skips its tests (the ``vllm`` marker) instead of failing at collection.
    import msgspec

    def value(v):
        if isinstance(v, torch.Tensor):
            return (str(v.dtype), v.tolist())
        if isinstance(v, msgspec.Struct):
            return {k: value(x) for k, x in msgspec.structs.asdict(v).items() if x is not None}
        return v

    return value(payload)


def _ours():
    from vllm_omni_moss.model_executor.models.moss_tts.talker_chunker import talker2codec_ramp_async_chunk

    return talker2codec_ramp_async_chunk


def _frames(gen, n: int, pad_rows: tuple[int, ...] = ()) -> torch.Tensor:
    codes = torch.randint(0, PAD, (n, N_VQ), generator=gen)
    for r in pad_rows:
        codes[r] = PAD
    return codes


# ----------------------------------------------------------------------------- parity without a ramp


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"initial_codec_chunk_frames": 3, "codec_chunk_frames": 5},
        {"initial_codec_chunk_frames": 1, "codec_chunk_frames": 15},
        {"codec_chunk_frames": 4},
        {"initial_codec_chunk_frames": 7, "codec_chunk_frames": 5},  # clamped to 5 by both
        {"initial_codec_chunk_frames": 2, "codec_chunk_frames": 0},  # steady 15 for both
    ],
)
def test_payloads_equal_upstream_raw_chunker_without_a_ramp(extra):
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer
    from vllm_omni.model_executor.stage_input_processors.moss_tts import talker2codec_raw_async_chunk

    gen = torch.Generator().manual_seed(1)
    # Per call: rows handed by the talker (pad rows included), then the finishing calls.
    calls = [_frames(gen, 1) for _ in range(9)] + [_frames(gen, 3, pad_rows=(1,)), _frames(gen, 1, pad_rows=(0,))]
    calls += [_frames(gen, 1)[0], _frames(gen, 7)]  # a 1-D frame, then more than a chunk in one call
    streams = {"a": calls, "b": calls[:2], "c": calls[:6]}
    ours, upstream = _manager(extra), _manager(extra)
    for rid, frames in streams.items():
        for i, f in enumerate(frames + [None]):
            finished = i == len(frames)
            want = _call(talker2codec_raw_async_chunk, upstream, rid, f, finished)
            got = _call(_ours(), ours, rid, f, finished)
            assert _plain(got) == _plain(want), (rid, i)
            # The bytes vLLM-Omni's connectors send are the same (our codes tensor wraps an int64 array).
            assert OmniSerializer.serialize(got) == OmniSerializer.serialize(want), (rid, i)
    # A request that ends right after a chunk: both send the terminal-only payload.
    frames = [_frames(gen, 1) for _ in range(40)]
    sent = {}
    for manager, fn in ((ours, _ours()), (upstream, talker2codec_raw_async_chunk)):
        sent[fn] = []
        for f in frames:
            sent[fn].append(_plain(_call(fn, manager, "d", f)))
            if sent[fn][-1] is not None:
                break
        sent[fn].append(_plain(_call(fn, manager, "d", None, True)))
    assert sent[_ours()] == sent[talker2codec_raw_async_chunk]
    assert "codes" not in sent[_ours()][-1] and sent[_ours()][-1]["meta"]["codec_chunk_frames"] == 0
    assert not ours.code_prompt_token_ids and not upstream.code_prompt_token_ids


def test_each_payload_tensor_has_memory_of_its_own():
    """vLLM-Omni's NIXL connector registers every tensor leaf of a payload as a DMA region
    (``NixlConnector._extract_tensor_leaves`` / ``_tensor_region``); NIXL refuses, or frees twice, a region
    registered twice, so no two leaves may share memory, as no two of upstream's do. A consumer editing one
    payload's tensors in place changes nothing else: not its other flag, not later payloads, not the pending codes."""
    from vllm_omni.distributed.omni_connectors.connectors.nixl_connector import NixlConnector
    from vllm_omni.model_executor.stage_input_processors.moss_tts import talker2codec_raw_async_chunk

    gen = torch.Generator().manual_seed(7)
    frames = _frames(gen, 5)
    for fn in (_ours(), talker2codec_raw_async_chunk):
        manager = _manager({"initial_codec_chunk_frames": 2, "codec_chunk_frames": 2})
        first = [_call(fn, manager, r, frames[:2]) for r in "ab"]
        _, leaves = NixlConnector._extract_tensor_leaves(first[0])
        regions = [NixlConnector._tensor_region(t) for t in NixlConnector._normalize_tensor_payload(leaves)[0]]
        assert len(leaves) == 3 and len(set(regions)) == 3, fn
        first[0].codes.audio.fill_(-1)
        first[0].meta.finished.fill_(True)
        assert not bool(first[0].meta.stream_finished), fn
        assert torch.equal(first[1].codes.audio, frames[:2].t().reshape(-1)) and not bool(first[1].meta.finished)
        last = _call(fn, manager, "a", frames[2:5], finished=True)
        assert torch.equal(last.codes.audio, frames[2:5].t().reshape(-1)), fn
        assert bool(last.meta.finished) and bool(last.meta.stream_finished), fn


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32])
def test_integer_frames_of_any_width_up_to_int64_give_upstreams_payloads(dtype):
    """vLLM-Omni's raw chunker reads any integer frames as int64, as Stage 1 reads any integer codes
    (``checks.is_integer_dtype``); ours refused uint16 and uint32 as "not integer codes"."""
    from vllm_omni.model_executor.stage_input_processors.moss_tts import talker2codec_raw_async_chunk

    low = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32) else -100  # negative codes, where they fit
    gen = torch.Generator().manual_seed(11)
    frames = [torch.randint(low, 100, (2, N_VQ), generator=gen).to(dtype) for _ in range(4)]
    if dtype not in (torch.uint8, torch.int8):
        frames[1][0] = PAD  # a pad row, dropped by both
    extra = {"initial_codec_chunk_frames": 2, "codec_chunk_frames": 3}
    ours, upstream = _manager(extra), _manager(extra)
    for i, f in enumerate(frames + [None]):
        finished = i == len(frames)
        got = _plain(_call(_ours(), ours, "a", f, finished))
        assert got == _plain(_call(talker2codec_raw_async_chunk, upstream, "a", f, finished)), (dtype, i)
    assert not ours.failures


# ----------------------------------------------------------------------------- ramps


def _chunk_sizes(extra: dict, frames: int, per_call: int = 1) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Chunk sizes our chunker sends for ``frames`` frames handed ``per_call`` at a time, the codes fed
    ``(n_vq, frames)`` and the codes sent, concatenated."""
    gen = torch.Generator().manual_seed(frames)
    codes = _frames(gen, frames)
    manager, sizes, sent = _manager(extra), [], []
    starts = list(range(0, frames, per_call))
    for k, a in enumerate(starts):
        out = _call(_ours(), manager, "r", codes[a : a + per_call], finished=k == len(starts) - 1)
        if out is not None and out.codes is not None:
            t = out.meta.codec_chunk_frames
            assert out.meta.code_flat_numel == t * N_VQ and out.codes.audio.dtype == torch.long
            sizes.append(t)
            sent.append(out.codes.audio.view(N_VQ, t))
    return sizes, codes.t(), torch.cat(sent, dim=1)


@pytest.mark.parametrize("ramp", RAMPS, ids=str)
def test_ramp_chunks_follow_vllm_omni_ramp_chunk_size(ramp):
    from vllm_omni.model_executor.stage_input_processors.chunk_size_utils import compute_ramp_emit, ramp_chunk_size

    steady = ramp[-1]
    frames = sum(ramp) + 2 * steady + 1  # the ramp, two steady chunks and a 1-frame tail
    sizes, fed, sent = _chunk_sizes({"codec_chunk_ramp": ramp, "codec_chunk_frames": steady}, frames)
    assert sizes[:-1] == [ramp_chunk_size(i, ramp, steady) for i in range(len(sizes) - 1)] and sizes[-1] == 1
    assert torch.equal(sent, fed)
    # vLLM-Omni's own emit rule (chunk_size_utils.compute_ramp_emit) over the same frames, one per call.
    want, index = [], 0
    for length in range(1, frames + 1):
        emit, n = compute_ramp_emit(length, index, ramp, steady, length == frames)
        if emit and n:
            want.append(n)
            index += 1
    assert sizes == want


def test_stream_shorter_than_the_first_ramp_step_is_one_terminal_chunk():
    sizes, fed, sent = _chunk_sizes({"codec_chunk_ramp": [3, 6], "codec_chunk_frames": 6}, 2)
    assert sizes == [2] and torch.equal(sent, fed)


@pytest.mark.parametrize("ramp", RAMPS, ids=str)
def test_core_chunk_schedule_reads_a_ramp_as_vllm_omni_does(ramp):
    from vllm_omni.model_executor.stage_input_processors.chunk_size_utils import ramp_chunk_size

    from vllm_omni_moss.model_executor.models.moss_tts.decoder import chunk_frames_at, chunk_schedule
    from vllm_omni_moss.model_executor.models.moss_tts.talker_chunker import chunk_schedule_of

    total = sum(ramp) + 3 * ramp[-1]
    widths = [b - a for a, b in chunk_schedule(total, ramp)]
    assert widths == [ramp_chunk_size(i, ramp, ramp[-1]) for i in range(len(widths))]
    for steady in (ramp[-1], 7):
        schedule = chunk_schedule_of({"codec_chunk_ramp": ramp, "codec_chunk_frames": steady})
        for i in range(len(ramp) + 3):
            assert schedule.size(i) == chunk_frames_at(i, ramp, steady) == ramp_chunk_size(i, ramp, steady)
    # The comma-separated form the benchmark's --chunks takes and vLLM-Omni's parser accepts.
    assert chunk_schedule_of({"codec_chunk_ramp": ",".join(map(str, ramp))}).ramp == tuple(ramp)


# ----------------------------------------------------------------------------- one schedule for both stages


@pytest.mark.parametrize(
    ("extra", "sizes"),
    [
        ({"initial_codec_chunk_frames": 3, "codec_chunk_frames": 0}, [3, 15]),
        ({"initial_codec_chunk_frames": 3}, [3, 15]),
        ({}, [15]),
        ({"initial_codec_chunk_frames": 20, "codec_chunk_frames": 5}, [5]),
        ({"codec_chunk_ramp": [1, 1, 2, 4, 6], "codec_chunk_frames": 6}, [1, 2, 4, 6]),
        ({"codec_chunk_ramp": "1,4", "codec_chunk_frames": 8}, [1, 4, 8]),
    ],
)
def test_stage_captures_a_graph_for_every_size_the_talker_sends(tmp_path, extra, sizes):
    """vLLM-Omni's talker reads a steady size of 0, or none, as 15 frames (``stage_input_processors/moss_tts.py``);
    the stage captured only the first size there, and cut every steady chunk into pieces."""
    from stage_helpers import vllm_config
    from vllm_omni.model_executor.stage_input_processors.moss_tts import talker2codec_raw_async_chunk

    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    stage = MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, N_VQ, extra=extra, enforce_eager=False))
    assert stage.graph_frame_sizes == sizes and stage.max_step_frames == max(sizes)
    chunkers = [_ours()] if "codec_chunk_ramp" in extra else [_ours(), talker2codec_raw_async_chunk]
    for fn in chunkers:
        assert _sent_sizes(fn, extra, 40) <= set(sizes)


def _sent_sizes(fn, extra: dict, frames: int) -> set[int]:
    """Sizes of the chunks ``fn`` sends for ``frames`` frames, one per call (the terminal one left out)."""
    manager, gen = _manager(extra), torch.Generator().manual_seed(0)
    out = [_call(fn, manager, "r", _frames(gen, 1)) for _ in range(frames)]
    return {p.meta.codec_chunk_frames for p in out if p is not None}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"codec_chunk_ramp": []},
            "connector extra codec_chunk_ramp must hold >= 2 sizes >= 1 (vLLM-Omni's rule), got []",
        ),
        (
            {"codec_chunk_ramp": [1, 0, 6]},
            "connector extra codec_chunk_ramp must hold >= 2 sizes >= 1 (vLLM-Omni's rule), got [1, 0, 6]",
        ),
        (
            {"codec_chunk_ramp": "4"},
            "connector extra codec_chunk_ramp must hold >= 2 sizes >= 1 (vLLM-Omni's rule), got '4'",
        ),
        ({"codec_chunk_ramp": [1, -2]}, "connector extra codec_chunk_ramp must hold frame counts >= 0, got [1, -2]"),
        (
            {"codec_chunk_ramp": [1, 101], "codec_chunk_frames": 6},
            "connector extra codec_chunk_ramp [1, 101] exceeds the stage's chunk limit of 100 frames",
        ),
        (
            {"codec_chunk_frames": 120},
            "connector extra codec_chunk_frames 120 exceeds the stage's chunk limit of 100 frames",
        ),
        (
            {"codec_chunk_ramp": [1, 4], "initial_codec_chunk_frames": 2},
            "connector extra sets both codec_chunk_ramp [1, 4] and initial_codec_chunk_frames 2: the ramp's first size "
            "is the first chunk; drop one",
        ),
        *(  # issue 51: misspelt schedule keys outside the old difflib ratio; the closed set refuses them
            (
                {key: value, "codec_chunk_frames": 6},
                f"connector extra names a key neither this package nor vLLM-Omni 0.30.0 reads: {key!r} (did you mean "
                f"{near!r}?). The chunk schedule's keys: codec_chunk_frames, codec_chunk_ramp, "
                "initial_codec_chunk_frames",
            )
            for key, value, near in (
                ("codec_initial_chunk_frames", 1, "initial_codec_chunk_frames"),
                ("initial_chunk_frames", 1, "initial_codec_chunk_frames"),
                ("codec_ramp", [1, 2, 4], "codec_chunk_ramp"),
            )
        ),
        (
            {"codec_ragged_steps": True},
            "connector extra 'codec_ragged_steps': codec_ragged_steps was removed: every step is ragged (packed), "
            "there is no grid step to switch from",
        ),
    ],
)
def test_bad_schedule_fails_at_stage_startup_and_at_the_chunkers_first_call(tmp_path, extra, message):
    from stage_helpers import vllm_config

    from vllm_omni_moss.model_executor.models.moss_tts.stage import MossTTSCodecDecoder

    with pytest.raises(ValueError) as err:
        MossTTSCodecDecoder(vllm_config=vllm_config(tmp_path, N_VQ, extra=extra))
    assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        _call(_ours(), _manager(extra), "r", torch.zeros(1, N_VQ, dtype=torch.long))
    assert str(err.value) == message


# ----------------------------------------------------------------------------- bad frames


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        (torch.zeros(1, N_VQ), "request a: codec frames must be integer codes, got dtype torch.float32"),
        (torch.zeros(1, N_VQ, dtype=torch.bool), "request a: codec frames must be integer codes, got dtype torch.bool"),
        (
            torch.zeros(1, N_VQ + 1, dtype=torch.long),
            f"request a: codec frames of {N_VQ + 1} codes after frames of {N_VQ} (n_vq changed)",
        ),
        (
            torch.zeros(1, 1, N_VQ, dtype=torch.long),
            f"request a: codec frames must be 2-D [frames, n_vq], got (1, 1, {N_VQ})",
        ),
        (
            torch.zeros(1, N_VQ, dtype=torch.uint64),
            "request a: codec frames must be integer codes of at most 64 bits signed, got dtype torch.uint64",
        ),
        # Frames torch cannot read out: they failed with torch's error, the request not failed, its later frames
        # accepted after the gap.
        (
            torch.ones(1, N_VQ, dtype=torch.long).to_sparse(),
            "request a: codec frames must be a dense tensor holding data, got layout torch.sparse_coo on device cpu",
        ),
        (
            torch.ones(1, N_VQ, dtype=torch.long, device="meta"),
            "request a: codec frames must be a dense tensor holding data, got layout torch.strided on device meta",
        ),
    ],
)
def test_bad_frames_fail_their_request_alone_naming_it(frames, message):
    from vllm_omni_moss.model_executor.models.moss_tts.talker_chunker import ChunkerError

    extra = {"codec_chunk_ramp": [1, 2], "codec_chunk_frames": 2}
    manager, gen = _manager(extra), torch.Generator().manual_seed(4)
    good = _frames(gen, 6)
    assert _call(_ours(), manager, "a", good[:1]).meta.codec_chunk_frames == 1
    assert _call(_ours(), manager, "b", good[:1]).meta.codec_chunk_frames == 1
    assert _call(_ours(), manager, "a", good[1:2]) is None  # one frame of a's next 2-frame chunk is pending
    with pytest.raises(ChunkerError) as err:
        _call(_ours(), manager, "a", frames)
    assert str(err.value) == message
    assert manager.failures == {"a-internal": f"MOSS talker chunker: {message}"}
    # a's pending frame and later frames are dropped; its terminal call still ends its stream.
    assert _call(_ours(), manager, "a", good[2:4]) is None
    tail = _call(_ours(), manager, "a", None, finished=True)
    assert tail.codes is None and tail.meta.codec_chunk_frames == 0 and bool(tail.meta.finished)
    # b goes on as if a had never been there.
    out = _call(_ours(), manager, "b", good[1:3], finished=True)
    assert out.meta.codec_chunk_frames == 2 and torch.equal(out.codes.audio, good[1:3].t().reshape(-1))
    assert not manager.code_prompt_token_ids


# ----------------------------------------------------------------------------- talker -> chunker -> stage


def test_talker_frames_through_the_chunker_into_the_stage_decode_like_the_codec(tmp_path):
    """Three requests of a talker-like driver (one frame per step each, pad rows, a request shorter than the first
    ramp step, one ending on a chunk boundary: a terminal-only payload) through the chunker and the connector's
    meta merge into a stage capturing the same schedule; each request's audio equals the codec's own decode of its
    codes in the chunks it was sent in."""
    extra = {"codec_chunk_ramp": [3, 1, 2, 4, 6], "codec_chunk_frames": 6}
    stage = build_stage(tmp_path, extra=extra)
    n_vq, K = stage.n_vq, stage._codec.config.codebook_size
    assert stage.graph_frame_sizes == [1, 2, 3, 4, 6]
    gen = torch.Generator().manual_seed(9)
    lengths = {"long": 23, "short": 2, "edge": 10}  # edge: 3 + 1 + 2 + 4 frames, then nothing
    codes = {r: torch.randint(0, K, (t, n_vq), generator=gen) for r, t in lengths.items()}
    manager = _manager(extra)
    metas: dict[str, dict] = {r: {} for r in lengths}
    audio: dict[str, list[torch.Tensor]] = {r: [] for r in lengths}
    sizes: dict[str, list[int]] = {r: [] for r in lengths}
    terminal_only = []
    for step in range(max(lengths.values()) + 1):
        segs, infos, rids = [], [], []
        for rid, t in lengths.items():
            if step > t:
                continue
            frames = codes[rid][step : step + 1] if step < t else torch.full((1, n_vq), PAD)  # a pad row at the end
            out = _call(_ours(), manager, rid, frames, finished=step == t)
            if out is None:
                continue
            meta = {k: v for k, v in _plain(out.meta).items() if k != "finished"}  # dropped on receipt
            metas[rid] = {**metas[rid], **{k: (v[1] if isinstance(v, tuple) else v) for k, v in meta.items()}}
            metas[rid]["stream_finished"] = torch.tensor(metas[rid]["stream_finished"])
            seg = out.codes.audio if out.codes is not None else torch.zeros(0, dtype=torch.long)
            if out.codes is None:
                terminal_only.append(rid)
            else:
                sizes[rid].append(out.meta.codec_chunk_frames)
            segs.append(seg)
            infos.append({"meta": dict(metas[rid]), "request_id": rid})
            rids.append(rid)
        if segs:
            for rid, wav in zip(rids, run(stage, segs, infos, rids)):
                audio[rid].append(wav)
    assert terminal_only == ["edge"]
    assert sizes == {"long": [3, 1, 2, 4, 6, 6, 1], "short": [2], "edge": [3, 1, 2, 4]}
    assert not stage._session.live_requests
    for rid in lengths:
        got = torch.cat(audio[rid], dim=-1)
        ref = fresh_decode(stage, codes[rid].t(), sizes[rid])
        assert got.shape == ref.shape
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), rid
