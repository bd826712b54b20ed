# SPDX-License-Identifier: Apache-2.0
"""Serving many streams over one pool: the session facade and the parts it is made of.

* :mod:`.session` - :class:`CodecStreamSession`, the facade the stage and the benchmarks use.
* :mod:`.scheduler` - streams, admission, waiting, preemption (one question to the pool: ``reserve``).
* :mod:`.step_runner` - cut chunks into steps (one ragged step per round), dispatch (graph or eager),
  copy audio back; :mod:`.step_inputs` stages each step's inputs.
* :mod:`.options` - :class:`SessionOptions`, a session's options in one frozen record.
* :mod:`.requests`, :mod:`.streams`, :mod:`.counters`, :mod:`.tracing` - what those parts exchange.
"""

from .options import SessionOptions
from .requests import ChunkRequest, ChunkResult
from .session import CodecStreamSession, collector_paused
from .tracing import CallTrace

__all__ = ["CallTrace", "ChunkRequest", "ChunkResult", "CodecStreamSession", "SessionOptions", "collector_paused"]
