# SPDX-License-Identifier: Apache-2.0
"""Whether a codec stage's decoder state fits the GPU memory its deploy file gives it.

vLLM-Omni 0.30.0 gives every stage replica a *memory share* of its GPU: ``gpu_memory_utilization`` times the
total memory CUDA reports for the device, rounded up to a byte (``vllm_omni/worker/memory_utils.py``,
``request_memory_tolerant``; when another stage on the same GPU started first and less is free, it takes what
is free instead). vLLM sizes only its own KV cache from that share. The codec allocates its decoder state
itself, so nothing in vLLM stops a Stage 1 from asking for more slots than its share holds: it would take
memory a stage sharing its GPU counted on, or fail with an out-of-memory error while capturing graphs. The
functions here answer before anything is allocated, and fail naming the slots, the bytes per slot and the
share (docs/serving.md, "Placing the codec stage apart").

Besides the decoder state the share holds the codec weights (2,172,687,872 bytes for the v2 decoder in bf16)
and :data:`STEP_RESERVE_BYTES` for the CUDA-graph pool, a step's activations and the CUDA context. Pure
functions of integers: no torch, no vLLM.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .checks import check_count
from .pool_kinds import POOL_KINDS, pool_kind_record

__all__ = [
    "STEP_RESERVE_BYTES",
    "MemoryShare",
    "check_stage_state",
    "check_state_fits",
    "pool_slots",
    "slots_that_fit",
]

GIB = 1 << 30

#: Bytes of a Stage 1 replica's share kept for the CUDA-graph pool, a step's activations and host-visible
#: buffers, and the CUDA context (which torch's allocator statistics do not count): about twice the peak
#: measured above the decoder state and the weights (docs/serving.md, "Placing the codec stage apart").
STEP_RESERVE_BYTES = 4 * GIB


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _check_int(name: str, value, minimum: int) -> None:
    check_count(value, name, minimum)


@dataclass(frozen=True)
class MemoryShare:
    """The memory vLLM-Omni requests for one stage replica: ``utilization`` of a device of ``device_bytes``.

    Attributes:
        utilization: the stage's ``gpu_memory_utilization``, in ``(0, 1]``.
        device_bytes: the device's total memory as CUDA reports it (``torch.cuda.mem_get_info()[1]``).

    Raises:
        ValueError: ``utilization`` is not a number in ``(0, 1]`` or ``device_bytes`` not an integer >= 1.
    """

    utilization: float
    device_bytes: int

    def __post_init__(self) -> None:
        u = self.utilization
        if isinstance(u, bool) or not isinstance(u, numbers.Real) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        _check_int("device_bytes", self.device_bytes, 1)

    @property
    def bytes(self) -> int:
        """``ceil(device_bytes x utilization)``, as vLLM-Omni computes the stage's request."""
        return math.ceil(self.device_bytes * self.utilization)

    def __str__(self) -> str:
        return f"gpu_memory_utilization {self.utilization:g} of {_gib(self.device_bytes)} = {_gib(self.bytes)}"


def pool_slots(pool_kind: str, max_num_seqs: int, graph_rows: int = 0) -> int:
    """Slots a pool of ``pool_kind`` allocates for ``max_num_seqs`` streams.

    ``"compact"``: one more, the null slot. ``"legacy"``: one scratch slot per padding row of the graph of most
    rows (``graph_rows``: one a slot, 0 without graphs). ``"paged"`` without a state budget: pages for full rings
    of every slot plus one null page per group, counted as one more slot (an upper bound).

    Raises:
        ValueError: unknown ``pool_kind``, ``max_num_seqs`` not an integer >= 1 or ``graph_rows``
            not an integer >= 0.
    """
    record = pool_kind_record(pool_kind)
    if record is None:
        raise ValueError(f"pool_kind must be one of {', '.join(map(repr, POOL_KINDS))}; got {pool_kind!r}")
    _check_int("max_num_seqs", max_num_seqs, 1)
    _check_int("graph_rows", graph_rows, 0)
    return max_num_seqs + record.extra_slots(graph_rows)


def slots_that_fit(bytes_per_slot: int, share: MemoryShare, reserved_bytes: int = 0) -> int:
    """How many slots of ``bytes_per_slot`` the share holds after ``reserved_bytes`` (0 when the reserve alone
    exceeds it)."""
    _check_int("bytes_per_slot", bytes_per_slot, 1)
    _check_int("reserved_bytes", reserved_bytes, 0)
    return max(0, share.bytes - reserved_bytes) // bytes_per_slot


def check_state_fits(
    slots: int, bytes_per_slot: int, share: MemoryShare, *, what: str, reserved_bytes: int = 0
) -> None:
    """Raise unless ``slots`` slots of ``bytes_per_slot`` fit ``share`` after ``reserved_bytes``.

    ``what`` names the setting that asked for the slots (``"Stage 1 max_num_seqs=2048"``); the message
    starts with it.

    Raises:
        ValueError: the state does not fit, naming the slots, the bytes per slot, the share and the slots it
            holds; or an argument is not an integer in range.
    """
    _check_int("slots", slots, 1)
    fit = slots_that_fit(bytes_per_slot, share, reserved_bytes)
    if slots <= fit:
        return
    need = slots * bytes_per_slot
    raise ValueError(
        f"{what} needs {slots} slots x {bytes_per_slot} bytes = {need} bytes ({_gib(need)}) of decoder state, "
        f"but its memory share ({share}), less {_gib(reserved_bytes)} for the codec weights, CUDA graphs and "
        f"step activations, holds {fit} slots: lower max_num_seqs or raise gpu_memory_utilization"
    )


def check_stage_state(
    *,
    max_num_seqs: int,
    pool_kind: str,
    bytes_per_slot: int,
    share: MemoryShare,
    reserved_bytes: int,
    graph_rows: int = 0,
    state_budget_bytes: int | None = None,
) -> None:
    """Raise unless a Stage 1 replica's decoder state fits its memory share.

    With ``state_budget_bytes`` (``hf_overrides`` ``codec_state_budget_gib``, a paged pool) the budget is the
    state; otherwise the state is :func:`pool_slots` slots of ``bytes_per_slot`` (``state_bytes_per_slot`` of
    the codec config at the ring dtype's element size). ``reserved_bytes`` is what the share must hold
    besides: the codec weights plus :data:`STEP_RESERVE_BYTES`.

    Raises:
        ValueError: the state does not fit (the message names the slots, the bytes per slot and the share, or
            the budget and the share), or an argument is out of range.
    """
    if state_budget_bytes is None:
        slots = pool_slots(pool_kind, max_num_seqs, graph_rows)
        check_state_fits(
            slots, bytes_per_slot, share, what=f"Stage 1 max_num_seqs={max_num_seqs}", reserved_bytes=reserved_bytes
        )
        return
    _check_int("state_budget_bytes", state_budget_bytes, 1)
    _check_int("reserved_bytes", reserved_bytes, 0)
    room = max(0, share.bytes - reserved_bytes)
    if state_budget_bytes <= room:
        return
    raise ValueError(
        f"Stage 1 codec_state_budget_gib={state_budget_bytes / GIB:g} needs {state_budget_bytes} bytes "
        f"({_gib(state_budget_bytes)}) of decoder state, but its memory share ({share}), less "
        f"{_gib(reserved_bytes)} for the codec weights, CUDA graphs and step activations, holds {room} bytes "
        f"({_gib(room)}): lower codec_state_budget_gib or raise gpu_memory_utilization"
    )
