# SPDX-License-Identifier: Apache-2.0
"""requests: a call's requests checked once (``check_batch``): result keys, accepted requests, per-request errors,
and the batch-wide errors that raise before anything changes."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.serving.requests import (
    ChunkRequest,
    InvalidRequestId,
    check_batch,
)

pytestmark = [pytest.mark.cpu, pytest.mark.core_model]


def test_check_batch_keys_accepts_and_refuses_each_request_once():
    good, ended = ChunkRequest("a", torch.zeros(2, 3, dtype=torch.int32)), ChunkRequest("e", torch.zeros(2, 0), True)
    batch = [
        good,
        ChunkRequest("", torch.zeros(2, 1, dtype=torch.long)),
        ChunkRequest("b", torch.zeros(3, 1, dtype=torch.long)),
        ChunkRequest("c", torch.zeros(2, 1)),
        ChunkRequest("d", torch.zeros(2, 1, dtype=torch.long), finished=1),
        ChunkRequest("m", torch.zeros(2, 1, dtype=torch.long, device="meta")),
        ChunkRequest("e", torch.zeros(2, 0, dtype=torch.long), True),
    ]
    checked = check_batch(batch, 2)
    assert checked.keys == ("a", InvalidRequestId(1, ""), "b", "c", "d", "m", "e")
    assert checked.accepted == (good, batch[-1]) and ended.request_id == "e"
    assert checked.refused == {
        InvalidRequestId(1, ""): "request_id must be a non-empty str, got ''",
        "b": "request 'b': codes must have shape (2, T), got (3, 1)",
        "c": "request 'c': codes must be signed integers (or uint8), got torch.float32",
        "d": "request 'd': finished must be a bool, got 1",
        "m": "request 'm': codes are on the meta device",
    }


def test_check_batch_raises_for_the_batch_as_a_whole():
    with pytest.raises(TypeError, match="^requests must be a sequence of ChunkRequest, got ChunkRequest$"):
        check_batch(ChunkRequest("a", torch.zeros(1, 1)), 1)
    with pytest.raises(TypeError, match="^requests must hold ChunkRequest objects, got tuple$"):
        check_batch([("a", torch.zeros(1, 1))], 1)
    twice = [ChunkRequest("x", torch.zeros(1, 1, dtype=torch.long))] * 2
    with pytest.raises(ValueError, match="^request 'x' appears twice in one decode batch$"):
        check_batch(twice, 1)
    # Invalid ids never collide: each keeps its own key and error.
    empty = [ChunkRequest("", torch.zeros(1, 1, dtype=torch.long))] * 2
    assert check_batch(empty, 1).keys == (InvalidRequestId(0, ""), InvalidRequestId(1, ""))


def test_invalid_request_ids_compare_by_position_type_and_repr():
    assert InvalidRequestId(2, 1) == InvalidRequestId(2, 1) and hash(InvalidRequestId(2, 1)) == hash(
        InvalidRequestId(2, 1)
    )
    assert InvalidRequestId(2, 1) != InvalidRequestId(2, True) != InvalidRequestId(2, 1.0)
    assert repr(InvalidRequestId(0, ["x"])) == "InvalidRequestId(0, ['x'])"
