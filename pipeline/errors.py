"""The errors that are the user's to fix: their message is the whole story, printed as one line with exit 2 by
the CLI, and carried as such from a training worker to the stage that launched it."""

from pipeline.config import ConfigError
from pipeline.durable import DiskFullError, no_room_line, out_of_room
from pipeline.jsonl import CorruptLineError
from pipeline.models.provision import ModelNotFoundError
from pipeline.models.vocab import TokenizerMismatchError
from pipeline.rundir import StageConflictError, StageInputError
from pipeline.serving.server import ServingError


class LosslessError(RuntimeError):
    """Speculative greedy output differs from the target's own greedy output (the stage fails in one line)."""


class AcceptanceMismatchError(RuntimeError):
    """An exported drafter's acceptance in transformers differs from our engine's with the same drafter (one line)."""


USER_ERRORS = (
    ConfigError,
    StageInputError,
    StageConflictError,
    ModelNotFoundError,
    FileNotFoundError,
    TokenizerMismatchError,
    ServingError,
    LosslessError,
    AcceptanceMismatchError,
    CorruptLineError,
    DiskFullError,
)


def user_error(exc: BaseException) -> BaseException | None:
    """``exc`` as the user's error to fix (a write that found no room anywhere becomes a DiskFullError), or None
    for a bug, whose traceback is wanted."""
    if isinstance(exc, USER_ERRORS):
        return exc
    if out_of_room(exc):
        return DiskFullError(no_room_line(exc, "what was written before it is kept"))
    return None
