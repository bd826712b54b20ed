# SPDX-License-Identifier: Apache-2.0
"""Host cost of Stage 0's talker chunker per code frame, on the CPU (needs vllm-omni; no GPU).

The talker hands each live stream's new frame to the chunker once per decode step: at 1,000 streams and 25
frames/s (talker RTF 0.5) that is 25,000 calls a second in the talker's process. This feeds ``--streams``
interleaved streams of ``--frames`` frames each, one ``[1, n_vq]`` int64 frame per call, through a stand-in for
vLLM-Omni's chunk transfer adapter, and prints microseconds per frame for this package's chunker
(``talker_chunker.talker2codec_ramp_async_chunk``, with the deploy files' ramp) and for vLLM-Omni 0.30.0's
``talker2codec_raw_async_chunk`` (its first and steady sizes), and two floors in the same process: a chunker
that does nothing (the loop's own cost) and one that only finds the request's state and copies the frame out of
the engine's tensor. The budget is 5 us a frame (docs/serving.md).

    .venv/bin/python benchmarks/tts/bench_chunker.py --streams 1000 --frames 50
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

RAMP = {"codec_chunk_ramp": [1, 1, 2, 4, 6], "codec_chunk_frames": 6}
UPSTREAM = {"initial_codec_chunk_frames": 3, "codec_chunk_frames": 5}


def _manager(extra: dict) -> SimpleNamespace:
    return SimpleNamespace(
        connector=SimpleNamespace(config={"extra": extra}),
        code_prompt_token_ids=defaultdict(list),
        request_payload={},
        put_req_chunk=defaultdict(int),
    )


def us_per_frame(fn, extra: dict, streams: int, frames: int, n_vq: int, seed: int) -> float:
    """CPU microseconds (this process's, so a loaded machine's other work is not counted) per frame of
    ``streams`` x ``frames`` calls, the last of each stream finishing it."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1024, (frames, streams, n_vq), generator=gen)
    rows = [[codes[t, r : r + 1] for r in range(streams)] for t in range(frames)]  # the talker's [1, n_vq] tensors
    requests = [SimpleNamespace(external_req_id=f"req-{r}", request_id=f"req-{r}") for r in range(streams)]
    manager = _manager(extra)
    start = time.process_time()
    for t in range(frames):
        last = t == frames - 1
        for r in range(streams):
            out = fn(manager, {"codes": {"audio": rows[t][r]}}, requests[r], is_finished=last)
            if out is not None:
                manager.put_req_chunk[requests[r].external_req_id] += 1
    return (time.process_time() - start) * 1e6 / (streams * frames)


def _no_op(transfer_manager, multimodal_output, request, is_finished: bool = False) -> None:
    return None


def _copy_only(transfer_manager, multimodal_output, request, is_finished: bool = False) -> None:
    """The least any chunker does per call: its request's state, and a copy of the frame the engine may reuse."""
    transfer_manager.code_prompt_token_ids[request.external_req_id].extend(multimodal_output["codes"]["audio"].tolist())
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1000, help="interleaved streams (1000)")
    p.add_argument("--frames", type=int, default=50, help="frames per stream (50 = 4 s of audio)")
    p.add_argument("--n-vq", type=int, default=12, help="codes per frame (MOSS-TTS-Local: 12)")
    p.add_argument("--repeats", type=int, default=3, help="runs per chunker; the fastest is printed (3)")
    args = p.parse_args(argv)
    for name, value in (("--streams", args.streams), ("--frames", args.frames), ("--n-vq", args.n_vq)):
        if not 1 <= value <= 100_000:
            p.error(f"{name} must be in [1, 100000], got {value}")
    if not 1 <= args.repeats <= 20:
        p.error(f"--repeats must be in [1, 20], got {args.repeats}")
    from vllm_omni.model_executor.stage_input_processors.moss_tts import talker2codec_raw_async_chunk

    from vllm_omni_moss.model_executor.models.moss_tts.talker_chunker import talker2codec_ramp_async_chunk

    torch.set_num_threads(1)
    for label, fn, extra in (
        ("vllm_omni_moss talker_chunker (ramp 1,1,2,4,6 then 6)", talker2codec_ramp_async_chunk, RAMP),
        ("vllm-omni 0.30.0 talker2codec_raw_async_chunk (3 then 5)", talker2codec_raw_async_chunk, UPSTREAM),
        ("floor: a chunker that does nothing (this loop's own cost)", _no_op, RAMP),
        ("floor: find the request's state, copy its frame out (one tolist)", _copy_only, RAMP),
    ):
        best = min(us_per_frame(fn, extra, args.streams, args.frames, args.n_vq, seed) for seed in range(args.repeats))
        print(f"{label}: {best:.2f} us/frame ({args.streams} streams x {args.frames} frames, n_vq={args.n_vq})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
