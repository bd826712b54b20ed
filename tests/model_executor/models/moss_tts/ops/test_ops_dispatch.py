# SPDX-License-Identifier: Apache-2.0
"""Tests for ``moss_tts.ops.dispatch``: where an op runs (kernel or reference), the device a launch runs on, and
the shape/dtype/device check every op's public function runs, with its exact messages."""

from __future__ import annotations

import contextlib

import pytest
import torch

from vllm_omni_moss.model_executor.models.moss_tts.ops import dispatch

cpu = pytest.mark.cpu


@cpu
@pytest.mark.parametrize("has_triton", [False, True])
@pytest.mark.parametrize("interpret", [False, True])
@pytest.mark.parametrize("allow", [False, True])
def test_cpu_runs_the_kernels_only_under_the_interpreter_with_triton_and_allowed(
    monkeypatch, has_triton, interpret, allow
):
    monkeypatch.setattr(dispatch, "HAS_TRITON", has_triton)
    monkeypatch.setattr(dispatch, "TRITON_INTERPRET_AT_IMPORT", interpret)
    monkeypatch.setattr(dispatch, "ALLOW_CPU_TRITON_INTERPRETER", allow)
    interpreted = has_triton and interpret and allow
    assert dispatch.cpu_uses_triton_interpreter() is interpreted
    for dtype in (torch.float32, torch.float16):
        assert dispatch.runs_triton_kernel(torch.zeros(2, dtype=dtype)) is interpreted
    assert dispatch.runs_triton_kernel(torch.zeros(2, dtype=torch.bfloat16)) is False  # the interpreter's bf16
    assert dispatch.runs_triton_kernel(torch.zeros(2, device="meta")) is False


@cpu
def test_the_interpreter_snapshot_is_the_environment_at_import():
    import os

    assert dispatch.TRITON_INTERPRET_AT_IMPORT is (os.environ.get("TRITON_INTERPRET", "0") == "1")
    assert dispatch.ALLOW_CPU_TRITON_INTERPRETER is True


@cpu
def test_device_guard_is_a_null_context_off_cuda():
    guard = dispatch.device_guard(torch.zeros(1))
    assert isinstance(guard, contextlib.nullcontext)
    with guard as entered:
        assert entered is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_always_run_the_kernel_on_their_device():
    x = torch.zeros(1, device="cuda", dtype=torch.bfloat16)
    assert dispatch.runs_triton_kernel(x) is True
    guard = dispatch.device_guard(x)
    assert isinstance(guard, torch.cuda.device)
    with guard:
        assert torch.cuda.current_device() == x.device.index


@cpu
@pytest.mark.parametrize(
    "value,shape,dtype,device,error,message",
    [
        ([1.0], (None,), None, None, TypeError, "op: `x` must be a torch.Tensor, got list"),
        (None, (None,), None, None, TypeError, "op: `x` must be a torch.Tensor, got NoneType"),
        (torch.zeros(2, 3), (2,), None, None, ValueError, "op: `x` must have shape (A, B) = (2,), got (2, 3)"),
        (torch.zeros(2, 3), (2, 4), None, None, ValueError, "op: `x` must have shape (A, B) = (2, 4), got (2, 3)"),
        (torch.zeros(2, 3), (None, 4), None, None, ValueError, "op: `x` must have shape (A, B) = (None, 4), got (2, 3)"),
        (torch.zeros(2, 3), (2, None), torch.int64, None, ValueError, "op: `x` must have dtype torch.int64, got torch.float32"),
        (torch.zeros(2, 3), (2, 3), torch.float32, torch.device("meta"), ValueError, "op: `x` must be on device meta, got cpu"),
    ],
)  # fmt: skip
def test_check_tensor_names_the_argument_and_the_fault(value, shape, dtype, device, error, message):
    with pytest.raises(error) as raised:
        dispatch.check_tensor("op", "x", value, "(A, B)", shape, dtype, device)
    assert type(raised.value) is error and str(raised.value) == message


@cpu
def test_check_tensor_accepts_what_it_is_asked_for():
    x = torch.zeros(2, 3, dtype=torch.int64)
    for shape in ((2, 3), (None, 3), (2, None), (None, None)):
        assert dispatch.check_tensor("op", "x", x, "(A, B)", shape, None, None) is None
    assert dispatch.check_tensor("op", "x", x, "(A, B)", (2, 3), torch.int64, torch.device("cpu")) is None
    assert dispatch.check_tensor("op", "x", torch.zeros(()), "()", (), torch.float32, None) is None
