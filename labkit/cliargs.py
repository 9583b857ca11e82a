"""Options of labs and benchmarks: --help shows every default, a bad value is one line.

    from labkit.cliargs import ArgParser, count, positive, at_least_zero
    p = ArgParser(prog="labkit run ddp")
    p.add_argument("--steps", type=count, default=3, help="SGD steps")
    a = p.parse_args(argv)     # "--steps 0" -> BadOption("labkit run ddp: argument --steps: ...")

The options every lab or benchmark shares are declared once here: lab_parser (`labkit run NAME`
and its --nproc), bench_parser (`labkit bench NAME`, its --ranks and --repeats), add_gpt_size,
group_lab_args (a lab whose flag cuts the ranks into groups: HSDP's replicas, ZeRO++'s hpZ).

argparse's own error() prints the whole usage and exits; a lab's main may run under torchrun or
inside `labkit bench`, so here a bad option raises BadOption (a ValueError): labkit.cli turns it
into one line on stderr and exit status 2, before any process starts.
"""
from __future__ import annotations

import argparse
import os

WORLD_HELP = "ranks (processes; under torchrun: its world size)"


class BadOption(ValueError):
    """An option the parser refused (a ValueError: labkit.cli's exit status 2)."""


class ArgParser(argparse.ArgumentParser):
    """ArgumentParser showing defaults in --help and raising BadOption instead of exiting."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        raise BadOption(f"{message} (see {self.prog} --help)")


def lab_parser(name: str, nproc: int, nproc_help: str = WORLD_HELP) -> ArgParser:
    """`labkit run NAME`'s parser with its --nproc, `nproc` by default; under torchrun, its world
    size (WORLD_SIZE), so that `torchrun --nproc-per-node N -m labkit run NAME` needs no --nproc."""
    p = ArgParser(prog=f"labkit run {name}")
    p.add_argument("--nproc", type=count, default=int(os.environ.get("WORLD_SIZE", nproc)),
                   help=nproc_help)
    return p


def bench_parser(name: str, ranks: list | None = None, repeats: int | None = None,
                 **kw) -> ArgParser:
    """`labkit bench NAME`'s parser; given their defaults, with --ranks (rank counts, one launch
    each) and --repeats (timed repeats, of which the benchmark reports the median). A
    benchmark's options(argv) returns this parser's parse_known_args (see labkit.bench)."""
    p = ArgParser(prog=f"labkit bench {name}", **kw)
    if ranks is not None:
        p.add_argument("--ranks", type=count, nargs="+", default=ranks,
                       help="rank counts to measure (one launch each)")
    if repeats is not None:
        p.add_argument("--repeats", type=count, default=repeats, help="timed repeats (median)")
    return p


def add_gpt_size(p: ArgParser, n_layer: int, n_embd: int, embd_help: str = "hidden size") -> None:
    """--n-layer and --n-embd: the depth and width of the tiny GPT (labkit.model)."""
    p.add_argument("--n-layer", type=count, default=n_layer, help="transformer blocks")
    p.add_argument("--n-embd", type=count, default=n_embd, help=embd_help)


def group_lab_args(argv, name: str, flag: str, group_help: str, steps: int, *, sizes: bool,
                   what: str, steps_help: str = "AdamW steps") -> argparse.Namespace:
    """A lab that cuts its ranks into groups (HSDP's --replicate, ZeRO++'s --hpz), with --nproc
    (4), `flag` (2) and --steps (AdamW steps, `steps`): the options, checked. `flag` is a group's
    size (sizes=True) or the number of groups (sizes=False); each group needs 2 ranks or more,
    else BadOption naming the flag and a value that works (`what` names the method)."""
    p = lab_parser(name, nproc=4)
    p.add_argument(flag, type=count, default=2, help=group_help)
    p.add_argument("--steps", type=count, default=steps, help=steps_help)
    args = p.parse_args(list(argv))
    nproc, value = args.nproc, getattr(args, flag.lstrip("-").replace("-", "_"))
    if nproc < 2:
        raise BadOption(f"--nproc {nproc}: {what} needs ranks to shard over; use --nproc 4")
    size = value if sizes else nproc // value
    if nproc % value or size < 2:
        even = nproc % 2 == 0
        use = (2 if even else nproc) if sizes else (2 if even and nproc >= 4 else 1)
        raise BadOption(f"{flag} {value} must divide --nproc {nproc} into groups of at least 2 "
                        f"ranks; use {flag} {use}")
    return args


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
