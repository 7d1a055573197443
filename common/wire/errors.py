"""Errors of the wire and the round logic, each carrying the gRPC status it maps to.

The cores (`RoundState`, codecs, framing) raise these without importing gRPC; the thin servicer maps
`error.status` (a `grpc.StatusCode` name) onto the call. One class per thing a client can get wrong, so
that tests and clients can tell the cases apart by code *and* by message.
"""

from __future__ import annotations


class DilocoxError(Exception):
    """Base class: a request was refused and nothing of it was applied."""

    status = "INTERNAL"


class InvalidFrame(DilocoxError):
    """A chunk or frame is malformed: bad offsets, sizes, codec parameters, non-finite values."""

    status = "INVALID_ARGUMENT"


class CorruptFrame(DilocoxError):
    """A zstd frame is truncated or corrupt (checksum or size mismatch)."""

    status = "DATA_LOSS"


class UnknownCodec(DilocoxError):
    """The frame names a codec (or version) this build cannot decode."""

    status = "UNIMPLEMENTED"


class UnknownSlice(DilocoxError):
    """A tensor slice this shard does not own (wrong name or row range)."""

    status = "NOT_FOUND"


class ShapeMismatch(DilocoxError):
    """A slice this shard owns, sent with the wrong shape or dtype."""

    status = "INVALID_ARGUMENT"


class ModelMismatch(DilocoxError):
    """A cluster's model (parameter names/shapes digest) differs from the run's."""

    status = "INVALID_ARGUMENT"


class TokenizerMismatch(ModelMismatch):
    """A cluster's tokenizer differs from the run's: the same ids would mean different text in one model."""


class WrongRun(DilocoxError):
    """The request names a run this shard is not serving."""

    status = "PERMISSION_DENIED"


class NotJoined(DilocoxError):
    """A cluster that has not joined tried to push or pull (join first)."""

    status = "FAILED_PRECONDITION"


class RoundNotOpen(DilocoxError):
    """A push for a round that is not the open one (late, early, or already initialised)."""

    status = "FAILED_PRECONDITION"


class RunOver(DilocoxError):
    """A push for a round past the run's final version: the run has ended (raise its rounds to go on)."""

    status = "OUT_OF_RANGE"


class NotReady(DilocoxError):
    """The requested weights do not exist yet within the wait the client allowed."""

    status = "DEADLINE_EXCEEDED"


class ShuttingDown(DilocoxError):
    """The shard is stopping (SIGTERM): retry, the same shard or its successor will answer."""

    status = "UNAVAILABLE"


class StreamStalled(DilocoxError):
    """A push stream sent nothing for longer than the shard's idle timeout: refused whole (nothing of it
    applied); a client whose link stalled pushes again."""

    status = "UNAVAILABLE"


class TooManyStreams(DilocoxError):
    """A cluster identity has more push streams open at one shard than the shard admits."""

    status = "RESOURCE_EXHAUSTED"


class NotAnOperator(DilocoxError):
    """An operator's request (a readmission) without the shard's operator token, or to a shard that has none."""

    status = "PERMISSION_DENIED"


class CheckOff(DilocoxError):
    """A request about the update check to a shard whose check is off (--update-check off)."""

    status = "FAILED_PRECONDITION"
