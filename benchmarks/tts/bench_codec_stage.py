# SPDX-License-Identifier: Apache-2.0
"""Main job: the MOSS-TTS codec stage under serving load, ours against upstream's, over a sweep of loads.

The code lives in the ``codec_stage`` package next to this file (``trace``: lengths, arrivals and codes;
``arms``; ``simulate``: the clock and the driver loop; ``playback``: stalls; ``metrics``; ``report``;
``plots``; ``cli``: flags and their checks; ``results``: results.json and ``--append``; ``sweep``: the loops).

Arms (one process, the same request trace for every arm at a given load):

* ``v2``       - our default :class:`CodecStreamSession` (compact pool for v2 codecs).
* ``legacy``   - the same session on the legacy pool (``pool_kind="legacy"``).
* ``upstream`` - vLLM-Omni 0.30.0's own codec model and pool from the published wheel, served with
  upstream's Stage-1 policy (``upstream_stage.py``: 2N slots, terminal chunks padded onto a captured graph
  frame size, CUDA graphs captured as upstream's stage does, and on CUDA the Triton attention backend of
  upstream's ``moss_tts_local_h200.yaml``). Skipped, with the reason printed, when the wheel's files are
  missing (set ``MOSS_UPSTREAM_MOSS_TTS_DIR`` to an unzipped wheel's ``moss_tts`` directory).
* ``ideal``    - no codec: correctly shaped zero audio at once, and the clock adds nothing for its calls (no
  weights). Its stalls and TTFP are those of the chunk schedule and the talker alone, so the codec's own
  share of every other arm's is visible.
* ``v2-paged`` - only when named in ``--arms``: the same session on the paged pool (``pool_kind="paged"``;
  ``--page-fraction`` of full rings for every slot, 1.0 by default, which never preempts), to measure the
  state its streams hold. ``--state-budget-gib`` instead gives each of our arms the state memory of a budget:
  the paged arm the pages it buys (the pool pays its null pages from it), the unpaged arms the most slots
  whose whole pool (null slot or scratch slots and offsets included) fits it (the other streams wait in the
  session's queue). ``--expected-stream-seconds`` (only with a budget) splits the paged budget by fill.

CUDA graphs (CUDA, without ``--eager``): every step of our arms is one packed (ragged) step per round, and they
capture the package's ladder of packed frame totals, ``graph_ladder.frame_totals(slots x the largest chunk
size)`` (every total to 64 frames, then totals at most 1/32 apart); upstream keeps its deploy file's batch
buckets below C plus C, times the schedule's chunk sizes. Each run records its ladder
(``details.<arm>.<key>.graph_ladder``: our frame totals, upstream's batch buckets) and the graphs captured.

Traffic. Request lengths are SYNTHETIC: log-normal, median 4.0 s, sigma 0.45, clipped to 13..256 frames (1.04
to 20.48 s), chosen to resemble the Seed-TTS test-en set of vLLM-Omni's MOSS-TTS benchmarks; codes uniform
random and weights random (timing and memory only). Each stream's talker takes ``--talker-rtf F`` seconds to
generate one second of codes: frames at ``12.5 / F`` frames/s from the request's start, so chunk ``[a, b)``
is ready at ``start + b * F / 12.5`` s (its last frame generated). The stage receives chunks that follow
``--chunks`` (a ramp: each size once in order, the last repeated; ``1,15`` = 1, 15, 15, ...; the last chunk is
what remains). ``--arrival``:

* ``wave`` (default): at concurrency ``C``, ``C * --requests-per-stream`` requests; the first ``C`` start at 0,
  each later one when a live stream ends (closed loop).
* ``staggered``: as ``wave``, but request ``i < C`` starts at ``i * (last chunk size) * F / 12.5 / C`` s (the
  first ``C`` starts spread evenly over one steady chunk's generation time).
* ``poisson``: open loop. Requests arrive with gamma-distributed gaps (shape ``--burstiness``, 1.0 = Poisson;
  mean ``1 / --request-rate`` s; the first at 0) until ``--warmup-seconds`` (10) + ``--measure-seconds`` (30)
  s of simulated time; at most ``--max-concurrency`` streams are live (default: ``--concurrency``, one value
  here: the slots every arm is built with, the ``ideal`` arm included, so that every arm sees the same
  admission; an unpaged arm under a state budget holds fewer slots and queues the rest inside its session,
  as in ``wave``); later arrivals wait in a FIFO queue and start when a live stream ends. The figures count
  the requests arriving in the measurement window ``[warm-up, warm-up + measure)`` and their chunks; the run
  ends when those have finished. ``--request-rate`` is a list swept like ``--concurrency``. Seeded by
  ``--seed``: every arm sees the same trace.

Clock: simulated (s). It jumps to the next event (a chunk ready, or an arrival that may start) when the codec
is idle, and advances by the measured wall time of each decode call otherwise (0 for ``ideal``). A decode
call is one stage batch: every chunk ready at that moment. A request's next chunk enters the stage only after
its previous one was sent.

Playback (per request): the client starts playing at its first audio and plays 12.5 frames of audio per
second. A stall is time during which all audio received so far has been played and the next chunk has not
arrived: with ``play_end`` the time the audio received so far runs out, a later chunk of ``f`` frames arriving
at ``t > play_end`` stalls for ``t - play_end`` and sets ``play_end = t + f / 12.5``; arriving earlier it adds
``f / 12.5`` to ``play_end``. A request's worst stall is its longest (0 if none); in a run stopped early, a
request cut off counts the stall it is in, and requests without audio count in no playback figure.

Figures per arm and run (``results.json``: ``arms.<arm>.<key>``, key = the concurrency, e.g. ``"64"``, for
wave and staggered, ``"rate=<R>"`` (``%g``) for poisson):

* ``codec_latency_ms`` {p10, p50, p90, p95, p99}: codec-added latency of every chunk, the first included: the
  time its audio comes out minus the time its last frame was generated.
* ``first_chunk_latency_ms`` {p50, p99}: first audio minus the request's start (the first chunk's
  generation included: ``F`` x 80 ms for a 1-frame chunk).
* ``ttfp_ms`` {p50, p95, p99}: first audio minus the request's arrival (= start in closed loop; queueing
  counts).
* ``underrun_ms`` {p50, p99}: over requests, each request's worst stall. ``underrun_requests``: the underrun
  count, requests whose playback stalled at least once (worst stall > 0; null without a request with audio).
* ``continuity`` {c50, c100, c200}: share of requests whose worst stall is at most 50 / 100 / 200 ms (c100 is
  vLLM-Omni's "continuity OK rate").
* ``live_streams`` {mean, max}: streams started and not ended, time-weighted mean and max over the
  measurement window (wave, staggered: the whole run).
* ``queued_requests`` and ``queue_wait_ms`` {p50, p99}: requests that waited for a live stream to end, and the
  start minus the arrival of every request (0 in closed loop; a request still queued when a run stops early
  counts with its wait so far).
* ``audio_seconds_per_second``: audio that came out in the measurement window per second of it. Capped near
  live streams / ``F`` by construction (each talker makes ``1 / F`` s of audio per s), so it is reported but
  is not the SLO.
* ``steps_by_path`` {graph, eager}: pool steps by path (ours: ``session.stats()``; upstream: the driver; 0 for
  ideal), ``padded_frame_fraction``: padded / (decoded + padded) frames of real rows, both over every decode
  call of the run (poisson: the warm-up included).
* ``peak_memory_bytes``: CUDA ``max_memory_allocated`` during the timed run (reset after setup and warm-up;
  weights, state, graph pools and activations of that arm); null on CPU.

``details.<arm>.<key>``: ``requests`` (counted), ``finished_requests``, ``chunks``, ``steps``,
``stopped_early``, ``serving_seconds``, ``window_seconds`` [start, end], ``codec_busy_seconds``,
``audio_seconds``, ``decoded_frames``, ``padded_frames``, ``padding_rows`` (rows graph replays carried beyond
their steps'), ``step_ms`` {p50, p99, max}, ``slowest_step``,
``setup_seconds``, ``preemptions``, ``preemptions_per_stream`` {max, mean} (our arms: over the streams that
ended in the run, by ``session.stats()["streams_by_preemptions"]``), ``session_wait_ms_max`` (the longest a
measured request's chunk stayed queued in the arm, for a slot or state pages: from the call that left it queued
to the call that returned its audio, simulated clock), ``slots``, ``state_bytes``, ``graphs``, ``graph_ladder``,
``peak_state_bytes`` (the most decoder state the live streams needed after any decode call:
``pool.state_in_use_bytes()``), ``state_bytes_over_time`` (``[seconds, bytes]`` after each decode call, cut to
at most 200 points keeping each run of calls' largest value), ``wall_seconds``; with ``--time-replays`` (CUDA,
our arms) ``replay_ms`` and ``host_ms`` (p50, p99) and their sums ``replay_seconds`` and ``host_seconds``; with
``--trace-calls`` (our arms) ``call_trace_ms`` (p50, p99 and sum of each ``session.CallTrace`` phase) and
``slowest_step.trace``; ``error`` for a run that ran out of memory.

SLO: ``codec_latency_ms.p99 <= --slo-ms`` (150). A run is stopped once a chunk's codec-added latency, a sent
chunk's wait, or a queued request's wait exceeds ``--give-up-ms``; it is then ``stopped_early`` (figures over
what was decoded) and misses the SLO whatever its p99. Sweep lines in ``arms.<arm>``: ``max_streams_at_slo``
(wave, staggered: the largest concurrency holding the SLO, null if none), or ``max_rate_at_slo`` (the largest
rate holding it) and ``live_streams_at_max_rate`` (that run's ``live_streams.mean``) for poisson; and
``slo_held_by_every_run`` (the limit is then only a lower bound: printed "at least N"; "none" when none held).
results.md recomputes these lines from the runs' figures, and adds per arm the largest load that holds the SLO
with no underrun (``underrun_requests`` 0). A complete run without a p99 (or, for the second line, without
``underrun_requests``) is "unknown", never a pass: its row and the arm's sweep line say so.
A warning is printed when a run's step time max exceeds 10x its p50, naming the slowest step's batch.

``run``: date, commit, command, invocations, device, device_name, torch, preset, n_vq, seed, ``arrival``,
``burstiness`` and ``request_rate``, ``max_concurrency``, ``warmup_seconds``, ``measure_seconds`` (poisson; null
otherwise), ``talker_rtf``, chunks, cuda_graphs, graph_frame_sizes, concurrency (poisson: [slots]), ``keys``
(the run keys), requests_per_stream (null for poisson), requests {key: counted requests}, length_model,
frame_rate, slo, give_up_ms, state_budget_gib, expected_stream_seconds, page_fraction, time_replays,
trace_calls, skipped {arm: reason}, ``host_load`` {cores, before, after, busy} (``os.getloadavg()`` before the
first run and after the last; busy, and a warning printed and kept in ``warnings``, when the 1-minute figure
exceeds cores - 0.5 before or cores + 0.5 after: this job's own process counts about 1 there),
``invocations[].wall_seconds`` (from the process start, imports included, through the reports). Top level:
``run``, ``arms``, ``details``, ``warnings``.

Writes into ``--out``: ``results.json`` (rewritten after every run), ``latencies.npz`` (every chunk's
codec-added latency in ms, keys ``"<arm>/<key>"``), ``results.md``, ``latency_cdf.png``, ``concurrency.png``
(``request_rate.png`` for poisson), ``playback.png`` (TTFP, underrun, continuity) and ``state_over_time.png``.
``--chunks`` takes several schedules separated by ``;`` or as repeated flags (``--chunks '1,15;1,4,15'``): each
schedule then gets a sub-directory ``chunks_1_15``, ``chunks_1_4_15``, ... holding all of the above, and
``--out`` gets ``sweep.json`` ({commit, date, command, arrival, schedules: {"1,15": "chunks_1_15", ...}})
and ``sweep.md`` (one table over the schedules), both rewritten after every run. The ``ideal`` arm runs first
(it takes no device time), so that a command cut short still has every schedule's own stalls. ``--append``
adds runs to an existing ``--out`` made at the same commit with the same settings (a sweep longer than one
command's time limit split in parts);
``--report-only`` rewrites the reports and plots from ``--out``, after reading and checking every file it needs
(``codec_stage.results.RESULTS_SHAPE``; ``latencies.npz`` included): a missing, truncated or bad one (``NaN``, a
``null`` or missing key) is
one line naming the file and the key, exit 2, and no report is written. Bad flags are usage errors (exit 2, one
line on stderr) before any arm runs. On a CPU the default is a tiny-v2 run with ``C`` in {4, 8}; a CPU run prints
first, and writes at the top of ``results.md``, that it checks the pipeline and shows no speed-up by design
(``report.cpu_note``); ``results.md`` then says what the run found, arm by arm and load by load
(``report.run_findings``). Before the first run every run prints a legend of its arms and figures once
(``report.legend``; the terms: docs/glossary.md, "Benchmarks and serving"). ``--chunks`` sizes are at most the stage's chunk limit, 100 frames
(``stage_options.DEFAULT_MAX_STEP_FRAMES``). ``results.md`` names the interpreter ``python`` with its version (``run.python``).

Changed from the single-module version of this job: ``--talker-rtf`` defaults to 0.5 (it was 1: frames at
12.5 frames/s); the ``ideal`` arm is a default arm; our arms take one packed step per round, on the ladder of
frame totals of their slots (they had upstream's batch buckets below C plus C), and the ladder moved into each
run's details (``graph_ladder``);
``codec_latency_ms`` gains p10 and p90; unpaged arms under a budget count their null or scratch slots; every
bad flag exits 2 (some exited 1 with a message, some with a traceback).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # run.invocations[].wall_seconds counts from here: imports and reports included

import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from codec_stage.sweep import main as _main  # noqa: E402


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the job (flags as in ``--help``); returns ``results.json``'s content, or for a ``--chunks`` sweep
    ``{"sweep": sweep.json's content, "results": {sub-directory: results}}``."""
    return _main(argv, __doc__.split("\n\n")[0], STARTED if argv is None else None)


if __name__ == "__main__":
    main()
