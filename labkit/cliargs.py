"""Options of labs and benchmarks: --help shows every default, a bad value is one line.

    from labkit.cliargs import ArgParser, count, positive, at_least_zero
    p = ArgParser(prog="labkit run ddp")
    p.add_argument("--steps", type=count, default=3, help="SGD steps")
    a = p.parse_args(argv)     # "--steps 0" -> BadOption("labkit run ddp: argument --steps: ...")

argparse's own error() prints the whole usage and exits; a lab's main may run under torchrun or
inside `labkit bench`, so here a bad option raises BadOption (a ValueError): labkit.cli turns it
into one line on stderr and exit status 2, before any process starts.
"""
from __future__ import annotations

import argparse


class BadOption(ValueError):
    """An option the parser refused (a ValueError: labkit.cli's exit status 2)."""


class ArgParser(argparse.ArgumentParser):
    """ArgumentParser showing defaults in --help and raising BadOption instead of exiting."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        raise BadOption(f"{message} (see {self.prog} --help)")


def count(text: str) -> int:
    """A whole number, 1 or more (processes, steps, repeats, sizes)."""
    return _whole(text, 1)


def at_least_zero(text: str) -> int:
    """A whole number, 0 or more."""
    return _whole(text, 0)


def positive(text: str) -> float:
    """A number above 0 (sizes in MiB, bandwidths, seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0 (got {text}); e.g. 1")
    return value


def _whole(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {low} or more (got {value}); e.g. {max(low, 1)}")
    return value
