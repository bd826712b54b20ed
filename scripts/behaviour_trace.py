# SPDX-License-Identifier: Apache-2.0
"""Decode one fixed-seed trace through every pool and write its audio and final state bytes.

A refactor that must not change behaviour is checked by running this script at the parent commit and at
the refactor's head and comparing the digests it prints (or the ``.npz`` files it writes) byte for byte:

    python scripts/behaviour_trace.py --out /tmp/before.npz     # at the parent commit
    python scripts/behaviour_trace.py --out /tmp/after.npz      # at the head
    cmp /tmp/before.npz /tmp/after.npz

The trace runs on the CPU, with random weights (``vllm_omni_moss.testing.weights``), for the ``tiny-v2`` and
``tiny-v1`` presets. Per scenario (codec, pool kind, attention backend, ring semantics) it

* streams six requests through a :class:`CodecStreamSession` of three slots: a chunk ramp of 1 then 4
  frames with shorter tails, one chunk longer than the largest frame size (cut into pieces), more streams
  than slots (the admission queue), an aborted stream (``on_requests_finished``) and, for the paged pool,
  too few pages for every stream (preemption, with save and restore);
* runs pool steps directly: two valid rows beside two graph padding rows, a slot saved, released and
  restored into another slot, then one more step;

and records every chunk's audio, the session's counters, every slot's rings and offsets (``slot_state``)
and the raw persistent tensors (``pool.rings`` and ``pool.offset_tensors()``; for paged rings, where the
physical page of a cell is the allocator's choice, the free page counts, the null pages and the frame
counters instead).

The ``triton`` backends (compact and paged pools) need the ``triton`` package and run in its interpreter,
which must be switched on before Triton is imported: the script sets ``TRITON_INTERPRET=1`` itself.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_omni_moss.model_executor.models.moss_tts.config import preset_config  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.decoder import CodecDecoder  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.serving import (  # noqa: E402
    ChunkRequest,
    CodecStreamSession,
    SessionOptions,
)
from vllm_omni_moss.model_executor.models.moss_tts.state import StateSpec, build_pool  # noqa: E402
from vllm_omni_moss.model_executor.models.moss_tts.step import decode_batch  # noqa: E402
from vllm_omni_moss.testing.weights import fill_random_weights_  # noqa: E402

#: (preset, pool kind, attention backend, ring semantics, page fraction)
SCENARIOS = (
    ("tiny-v2", "compact", "sdpa", "upstream", None),
    ("tiny-v2", "compact", "sdpa", "exact", None),
    ("tiny-v2", "compact", "triton", "upstream", None),
    ("tiny-v2", "compact", "triton", "exact", None),
    ("tiny-v2", "legacy", "sdpa", "upstream", None),
    ("tiny-v2", "legacy", "sdpa", "exact", None),
    ("tiny-v2", "paged", "triton", "upstream", 0.6),
    ("tiny-v2", "paged", "triton", "exact", 0.6),
    ("tiny-v1", "legacy", "sdpa", "exact", None),
    ("tiny-v1", "legacy", "sdpa", "upstream", None),
)
SLOTS = 3
FRAME_SIZES = (1, 4)


def _decoder(preset: str) -> CodecDecoder:
    decoder = CodecDecoder(preset_config(preset))
    return fill_random_weights_(decoder, seed=7).eval()


def _state_arrays(prefix: str, pool, out: dict[str, np.ndarray]) -> None:
    """Every live slot's logical state and the pool's raw persistent tensors."""
    for slot in range(pool.state_capacity):
        state = pool.slot_state(slot)
        out[f"{prefix}/slot{slot}/offsets"] = state["layer_offsets"].numpy()
        for layer, ring in enumerate(state["rings"]):
            out[f"{prefix}/slot{slot}/ring{layer}"] = ring.float().numpy()
    if hasattr(pool, "free_page_counts"):
        # Paged rings: which physical page holds a cell is the allocator's choice, not behaviour; the pages
        # still free and the null page (page 0, read by padding rows) are.
        out[f"{prefix}/free_pages"] = np.array(pool.free_page_counts())
        for i, t in enumerate(pool.rings):
            out[f"{prefix}/null_page{i}"] = t[:, 0].float().numpy()
        out[f"{prefix}/frames_decoded"] = pool.frames_decoded.numpy()
        return
    for i, t in enumerate(pool.rings):
        out[f"{prefix}/raw_ring{i}"] = t.float().numpy()
    for i, t in enumerate(pool.offset_tensors()):
        out[f"{prefix}/raw_offsets{i}"] = t.numpy()


def _session_trace(name: str, decoder, kind, backend, semantics, fraction, out) -> None:
    spec = StateSpec.from_options(
        decoder, kind=kind, attention_backend=backend, ring_semantics=semantics, page_fraction=fraction
    )
    options = SessionOptions(SLOTS, graph_frame_sizes=tuple(FRAME_SIZES), max_waiting_streams=8)
    session = CodecStreamSession(decoder, spec, options)
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    K, n_vq = decoder.config.codebook_size, decoder.config.num_quantizers
    lengths = [rng.randint(5, 30) for _ in range(6)]
    codes = [torch.randint(0, K, (n_vq, n), generator=gen) for n in lengths]
    chunks = []
    for r, n in enumerate(lengths):
        sizes = [1] + ([9] if r == 2 else []) + [4] * n
        cut, a = [], 0
        for s in sizes:
            if a >= n:
                break
            cut.append((a, min(n, a + s)))
            a += s
        chunks.append(cut)
    nxt = [0] * len(lengths)
    aborted = 4
    call = 0
    while any(nxt[r] < len(chunks[r]) for r in range(len(lengths))):
        open_ids = [r for r in range(len(lengths)) if nxt[r] < len(chunks[r])]
        batch = [r for r in open_ids if rng.random() < 0.7] or open_ids[:1]
        requests = []
        for r in batch:
            a, b = chunks[r][nxt[r]]
            nxt[r] += 1
            requests.append(ChunkRequest(f"req-{r}", codes[r][:, a:b], nxt[r] == len(chunks[r])))
        results = session.decode(requests)
        for rid, res in sorted(results.items()):
            out[f"{name}/call{call}/{rid}/audio"] = res.audio.numpy()
            out[f"{name}/call{call}/{rid}/flags"] = np.array([res.frames, res.queued, res.error is not None])
        if call == 3:
            session.on_requests_finished([f"req-{aborted}"])
            nxt[aborted] = len(chunks[aborted])
        call += 1
    stats = session.stats()
    out[f"{name}/stats"] = np.array(
        [stats["decoded_frames"], stats["padded_frames"], stats["admitted_from_queue"], stats["preemptions"]]
    )
    _state_arrays(f"{name}/session", session.pool, out)
    session.close()


def _pool_trace(name: str, decoder, kind, backend, semantics, out) -> None:
    spec = StateSpec.from_options(decoder, kind, ring_semantics=semantics, attention_backend=backend)
    pool = build_pool(decoder, spec)
    pool.initialize(SLOTS, pool.scratch_slots_for(2))
    a, b = pool.acquire(), pool.acquire()
    gen = torch.Generator().manual_seed(5)
    K, n_vq = decoder.config.codebook_size, decoder.config.num_quantizers
    padding = pool.padding_slot_ids(2)
    slots = torch.cat([torch.tensor([a, b]), padding])
    valid = torch.tensor([True, True, False, False])
    for step, T in enumerate((3, 4, 2)):
        codes = torch.randint(0, K, (n_vq, 4, T), generator=gen)
        lengths = torch.tensor([T, T - 1, 0, 0])
        audio, audio_lengths = decode_batch(pool, codes, lengths, slots, valid)
        out[f"{name}/pool/step{step}/audio"] = audio.numpy()
        out[f"{name}/pool/step{step}/lengths"] = audio_lengths.numpy()
        for s in pool.slots_dirtied_by_padding(2):
            pool.reset([s])
    saved = pool.save_slot(a)
    pool.release([a])
    c = pool.acquire()
    c = pool.acquire() if c == a else c
    pool.restore_slot(c, saved)
    codes = torch.randint(0, K, (n_vq, 1, 3), generator=gen)
    audio, _ = decode_batch(pool, codes, torch.tensor([3]), torch.tensor([c]), torch.tensor([True]))
    out[f"{name}/pool/restored/audio"] = audio.numpy()
    _state_arrays(f"{name}/pool", pool, out)
    pool.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the .npz to write (every array of the trace)")
    args = p.parse_args(argv)
    target = Path(args.out)
    if target.is_dir() or not target.parent.is_dir():
        p.error(f"--out {args.out!r}: {'is a directory' if target.is_dir() else 'its directory does not exist'}")
    if not os.access(target.parent, os.W_OK):
        p.error(f"--out {args.out!r}: its directory is not writable")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out: dict[str, np.ndarray] = {}
    decoders: dict[str, CodecDecoder] = {}
    for preset, kind, backend, semantics, fraction in SCENARIOS:
        decoder = decoders.setdefault(preset, _decoder(preset))
        name = f"{preset}/{kind}/{backend}/{semantics}"
        before = len(out)
        with torch.no_grad():
            _session_trace(name, decoder, kind, backend, semantics, fraction, out)
            _pool_trace(name, decoder, kind, backend, semantics, out)
        digest = hashlib.sha256(b"".join(out[k].tobytes() for k in list(out)[before:])).hexdigest()
        print(f"{name}: {len(out) - before} arrays, sha256 {digest[:16]}")
    buffer = io.BytesIO()
    np.savez(buffer, **out)
    Path(args.out).write_bytes(buffer.getvalue())
    print(f"all: {len(out)} arrays, sha256 {hashlib.sha256(buffer.getvalue()).hexdigest()[:16]} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
