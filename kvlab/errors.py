"""Exceptions kvlab raises for conditions a caller may want to catch by type."""


class KVLabError(Exception):
    """Base class of kvlab's own exceptions."""


class OutOfBlocksError(KVLabError):
    """The block pool has too few free blocks for the request; nothing was changed."""


class UnknownSequenceError(KVLabError, KeyError):
    """A sequence id that the pool does not hold (never allocated, or already freed)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class SharedBlockWriteError(KVLabError):
    """A write to a block that other sequences share, bypassing copy-on-write; nothing was written."""


class EngineDeadError(KVLabError, RuntimeError):
    """The engine cannot run another step: a tensor-parallel worker died, or a step failed
    half-way with the ranks out of step. Close the engine and start a new one."""
