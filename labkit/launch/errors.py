"""What a run raises: bad input (LaunchError), a failed rank (RankError), a hang (HangError)."""
from __future__ import annotations


class LaunchError(RuntimeError):
    """A run could not be started as asked (bad world size, backend, ...)."""


class RankError(RuntimeError):
    """A rank raised (or died). `.rank` is the first rank that failed; `.remote_traceback` its
    text."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "", others=()):
        self.rank, self.remote_traceback, self.others = rank, remote_traceback, list(others)
        super().__init__(message)


class HangError(TimeoutError):
    """The run did not finish within its timeout. `.stacks[rank]` is where each rank was stuck."""

    def __init__(self, message: str, stacks: dict, notes: dict):
        self.stacks, self.notes = stacks, notes
        super().__init__(message)
