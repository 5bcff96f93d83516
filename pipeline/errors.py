"""The errors that are the user's to fix: their message is the whole story, printed as one line with exit 2 by
the CLI, and carried as such from a training worker to the stage that launched it.

Defined here, below the modules that raise them, and importing neither torch nor transformers: the CLI reports a
bad argument or config in one line without first spending seconds importing them (8-10 s on a 2-core CPU)."""

from pipeline.config import ConfigError
from pipeline.durable import DiskFullError, no_room_line, out_of_room
from pipeline.jsonl import CorruptLineError


class StageInputError(RuntimeError):
    """An input stage has not completed; the message names the make target that produces it."""


class StageConflictError(RuntimeError):
    """The stage directory holds results of a different config."""


class ModelNotFoundError(FileNotFoundError):
    """A model cannot be found or is corrupt; the message names the fix."""


class TokenizerMismatchError(ValueError):
    """Drafter and target tokenizers differ; drafting with it would be meaningless."""


class ServingError(RuntimeError):
    """The inference server could not start or stopped answering; the message is one line."""


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
