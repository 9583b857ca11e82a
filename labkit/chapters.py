"""The chapter manifest: what each chapter of the book is made of, in one place.

    from labkit.chapters import CHAPTERS, chapter, lab
    chapter(3).notebooks     # ('chapters/03_zero_fsdp.ipynb', 'exercises/...', 'solutions/...')
    chapter(3).checker       # 'labkit.check.ch03'
    [x.name for x in chapter(3).labs]   # ['zero', 'overlap_zero3', 'hsdp', 'zeropp']

Everything that lists chapters reads this table: `labkit list` and labkit.labs (labs by
chapter), the landing page (labkit.landing), the website (labkit.site: pages, navigation,
calculators), labkit.book and labkit.chapter_stats (which notebooks), the website's calculators
(labkit.widgets.web: which chapter a calculator stands in) and the tests (tests/test_labs.py's
quick runs, tests/test_documented_commands.py's promises, tests/test_chapters.py). A new chapter
is its three notebooks, its implementation, its checker package and one entry here
(docs/architecture.md, "Adding a chapter").

Pure data: no work at import time and nothing imported but the standard library, so the website's
Pyodide and `labkit list` read it without torch.
"""
from __future__ import annotations

from dataclasses import dataclass

FOLDERS = ("chapters", "exercises", "solutions")   # where each chapter's three notebooks live
# The exercise notebook's file names itself: JupyterLab titles a tab with the file's name, so a
# chapter and its exercises open as "02_data_parallel.ipynb" and "02_data_parallel_exercises.ipynb"
EXERCISE_SUFFIX = "_exercises"


@dataclass(frozen=True)
class Lab:
    """A lab: `labkit run NAME --nproc N` runs labkit.labs.NAME.main."""
    name: str
    quick: tuple = ()     # options for a run of seconds (tests/test_labs.py, documented lines)
    table: str = ""       # a line its final table always prints
    shows: tuple = ()     # what its documented `labkit run` line says it shows (case-insensitive)


@dataclass(frozen=True)
class Chapter:
    number: int
    slug: str             # chapters/NN_slug.ipynb, exercises/NN_slug.ipynb, solutions/NN_slug.ipynb
    title: str            # the notebook's first heading, after "Chapter NN — "
    labs: tuple = ()      # Lab entries, in the order `labkit list` shows them
    calculators: tuple = ()   # keys of labkit.widgets.web.CALCULATORS shown in this chapter

    @property
    def nn(self) -> str:
        return f"{self.number:02d}"

    @property
    def stem(self) -> str:
        return f"{self.nn}_{self.slug}"

    @property
    def notebooks(self) -> tuple:
        """Its three notebooks, relative to the book's root: chapter, exercises, solutions."""
        return tuple(f"{folder}/{self.stem}{EXERCISE_SUFFIX if folder == 'exercises' else ''}.ipynb"
                     for folder in FOLDERS)

    @property
    def checker(self) -> str:
        """The checker package its exercises' checker cells import (`@graded("N.k")` inside)."""
        return f"labkit.check.ch{self.nn}"

    @property
    def lab_names(self) -> tuple:
        return tuple(x.name for x in self.labs)


MEASURED = ("predicted", "measured")

CHAPTERS = (
    Chapter(0, "why_distribute", "Why distribute?",
            labs=(Lab("intro", ("--sizes-kib", "4", "256", "--repeats", "2"), "bytes/param",
                      ("bytes/param",)),),
            calculators=("intro", "roofline")),
    Chapter(1, "collectives", "Collectives and ring all-reduce",
            labs=(Lab("ring", ("--sizes-mib", "0.0625", "--repeats", "1"),
                      "max bytes received by a rank", ("ring", "parameter server", "builtin")),)),
    Chapter(2, "data_parallel", "Data parallelism: from naive to bucketed, overlapped DDP",
            labs=(Lab("ddp", ("--steps", "1", "--batch", "5", "--versions", "bucketed", "torch"),
                      "all-reduces/step", ("naive", "overlap", "bucketed", "torch")),
                  Lab("overlap", ("--rows", "1", "2", "--rounds", "1", "--n-embd", "16",
                                  "--sizes-kib", "64", "1024", "4096"),
                      "where the step turns communication-bound", MEASURED)),
            calculators=("ddp",)),
    Chapter(3, "zero_fsdp", "ZeRO and FSDP",
            labs=(Lab("zero", ("--steps", "1", "--stages", "1", "3"), "the ring predicts",
                      ("the ring predicts",)),
                  Lab("overlap_zero3", ("--rows", "1", "2", "--rounds", "1", "--n-embd", "16",
                                        "--sizes-kib", "64", "4096"),
                      "where the micro-batch turns communication-bound", MEASURED),
                  Lab("hsdp", ("--steps", "1"), "HSDP: bytes each rank sent, per mesh dimension",
                      ("shard dim", "replicate dim", "one process")),
                  Lab("zeropp", ("--steps", "1"), "ZeRO++: bytes each rank sent in one step",
                      ("qwZ", "hpZ", "qgZ", "all held"))),
            calculators=("memory",)),
    Chapter(4, "tensor_parallel", "Tensor parallelism (Megatron style)",
            labs=(Lab("tp", ("--steps", "1", "--batch", "2", "--n-layer", "1", "--block-size",
                             "8"), "all-reduces for 1 layers",
                      ("per layer (formula: 4)", "counted by the kernel")),
                  Lab("overlap_tp", ("--widths", "16", "32", "--tokens", "16", "--rounds", "1",
                                     "--sizes-kib", "4096"),
                      "where a TP layer turns communication-bound", MEASURED)),
            calculators=("tp",)),
    Chapter(5, "pipeline_parallel", "Pipeline parallelism",
            labs=(Lab("pipeline", ("--K", "2", "--batch", "4", "--pad-ms", "0", "0"),
                      "formula (P-1)/(vK+P-1)",
                      ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "formula")),),
            calculators=("pipeline",)),
    Chapter(6, "checkpointing", "Checkpointing and fault tolerance",
            labs=(Lab("checkpoint", (), "straggler (rank 1 slowed 3x) found",
                      ("straggler", "sharded save at 4, load at 2", "frozen rank")),
                  Lab("train_ft", ("--steps", "4", "--save-every", "2", "--kill-step", "3"),
                      "ranks agree: True", ("rank 1 died", "bit for bit"))),
            calculators=("checkpoint",)),
    Chapter(7, "sequence_and_context",
            "Sequence and context parallelism: where activation memory goes",
            labs=(Lab("sequence", ("--steps", "1", "--seq", "8", "--batch", "2"),
                      "SGD steps vs the one-process reference",
                      ("SGD steps vs the one-process reference",)),
                  Lab("context", ("--steps", "1", "--seq", "8", "--batch", "2"),
                      "SGD steps vs the one-process reference",
                      ("ring", "SGD steps vs the one-process reference")),
                  Lab("overlap_cp", ("--chunks", "8", "16", "--heads", "2", "--head-dim", "8",
                                     "--rounds", "1", "--sizes-kib", "256"),
                      "where a ring hop stops hiding", MEASURED)),
            calculators=("activations", "context-comm")),
    Chapter(8, "mixture_of_experts", "Mixture of experts and expert parallelism",
            labs=(Lab("moe", ("--steps", "1", "--batch", "4"), "expert parallel vs one-process MoE",
                      ("expert parallel vs one-process MoE", "all-to-all")),
                  Lab("moe_dispatch", ("--tokens", "64", "--hidden", "16", "--skews", "0", "2",
                                       "--repeats", "1", "--sizes-kib", "4", "16"),
                      "dispatch all-to-all under skewed routing",
                      ("uniform model", "skewed model", "hidden"))),
            calculators=("moe",)),
    Chapter(9, "mixed_precision", "Mixed precision: numbers in fewer bits",
            labs=(Lab("precision", ("--steps", "2"), "resident bytes/param",
                      ("resident bytes/param", "loss scal")),),
            calculators=("precision",)),
    Chapter(10, "putting_it_together", "Putting it together: every parallelism on one model",
            labs=(Lab("hybrid", ("--steps", "1", "--batch", "3"), "worst |difference|",
                      ("worst |difference|",)),),
            calculators=("planner",)),
)


def chapter(number: int) -> Chapter:
    for c in CHAPTERS:
        if c.number == int(number):
            return c
    raise KeyError(f"no chapter {number} in labkit.chapters.CHAPTERS "
                   f"(chapters: {', '.join(c.nn for c in CHAPTERS)})")


def labs() -> tuple:
    """Every chapter's labs, in chapter order."""
    return tuple(x for c in CHAPTERS for x in c.labs)


def lab(name: str) -> Lab:
    for x in labs():
        if x.name == name:
            return x
    raise KeyError(f"no lab {name!r} in labkit.chapters (labs: "
                   f"{', '.join(x.name for x in labs())})")


def chapter_of_calculator(key: str) -> Chapter | None:
    """The chapter whose notebook shows calculator `key`."""
    return next((c for c in CHAPTERS if key in c.calculators), None)
