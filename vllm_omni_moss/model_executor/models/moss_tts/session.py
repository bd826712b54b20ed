# SPDX-License-Identifier: Apache-2.0
"""Old import path of the streaming session, kept for one release: it lives in :mod:`.serving`."""

from .serving.requests import ChunkRequest, ChunkResult
from .serving.session import CodecStreamSession
from .serving.streams import AdmissionQueue
from .serving.tracing import CallTrace

__all__ = ["AdmissionQueue", "CallTrace", "ChunkRequest", "ChunkResult", "CodecStreamSession"]
