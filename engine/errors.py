"""Engine errors that callers must tell apart. Each maps to one gRPC status in the servicer."""
from __future__ import annotations


class EngineError(Exception):
    """Base class for errors the engine reports to a caller."""


class QueueFullError(EngineError):
    """The waiting queue is at its bound; the caller may retry later (RESOURCE_EXHAUSTED)."""


class ContextLengthError(EngineError, ValueError):
    """The prompt (plus what must be generated) does not fit the context window (OUT_OF_RANGE)."""


class UnsupportedError(EngineError):
    """The model lacks a capability the request needs, e.g. embeddings or infilling (UNIMPLEMENTED)."""


class EngineUnavailableError(EngineError):
    """The engine is loading, draining or stopped (UNAVAILABLE)."""


class ModelLoadError(EngineError):
    """A model file is missing, corrupt, of an unsupported architecture or of an unexpected shape."""
