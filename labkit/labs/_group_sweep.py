"""A crossover lab whose ranks are one parallel group, sweeping one size (overlap_tp's widths,
overlap_cp's tokens per rank): its command line and its figure, as data. The rest of what the
crossover labs share is labkit.labs._crossover's.

    LAB = GroupSweep("overlap_tp", "TP", "--widths", (32, 64), "widths to sweep", "width", ...)
    p = LAB.parser()            # lab_parser with --nproc as the group's degree and the sweep
    fig = LAB.figure(res)       # measured and predicted ratio against x, crossovers marked
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.cliargs import ArgParser, count, lab_parser
from labkit.labs._crossover import ratio_figure


@dataclass(frozen=True)
class GroupSweep:
    """A lab whose ranks are one parallel group (--nproc is its `degree`) sweeping one size `x`
    (overlap_tp's widths, overlap_cp's tokens per rank): its command line and its figure."""
    name: str         # labkit run <name>
    degree: str       # "TP", "CP"
    flag: str         # the swept option; `sizes` its default
    sizes: tuple
    sizes_help: str
    x: str            # the swept size's key in res["rows"], with "ratio" and "ratio_model"
    label: str        # a crossover's legend entry (mark_crossovers)
    xtitle: str
    ytitle: str
    title: str        # the figure's title, formatted with res ("{nproc}")

    def parser(self) -> ArgParser:
        p = lab_parser(self.name, nproc=2, nproc_help=f"ranks, the {self.degree} degree "
                       "(processes; under torchrun: its world size)")
        p.add_argument(self.flag, type=count, nargs="+", default=list(self.sizes),
                       help=self.sizes_help)
        return p

    def figure(self, res: dict):
        """comm / compute against x, measured and predicted, crossovers marked (plotly)."""
        rows = res["rows"]
        return ratio_figure([r[self.x] for r in rows], [r["ratio"] for r in rows],
                            [r["ratio_model"] for r in rows],
                            ("measured", "alpha-beta / (FLOPs / C)"), res,
                            ((f"predicted_{self.x}", "predicted", "black"),
                             (f"measured_{self.x}", "measured", "firebrick")),
                            self.label, self.xtitle, self.ytitle, self.title.format(**res),
                            dict(width=1))
