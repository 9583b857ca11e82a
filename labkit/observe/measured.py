"""A number measured next to the one predicted for it: the row every lab and checker prints.

    rows = [Measured("tp all-reduce bytes", measured=got, predicted=want, counter="kernel TCP")]
    print(measured_table(rows, title="rank 0"))     # what, measured, predicted, ratio, counter
    rows[0].ratio                                   # measured / predicted; None if unmeasured

measured is None where no counter can see the quantity (NCCL over NVLink, no /proc): the table
shows an empty cell there, never a predicted value passed off as measured. `counter` names what
measured it, so a reader knows which counter to trust: "kernel TCP" (labkit.observe.netcount),
"saved-tensor hooks" (labkit.observe.saved), "storage sizes" (labkit.observe.storage),
"dispatch mode" (labkit.observe.dispatch), "commlog" (what labkit's wrappers asked for).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.table import table


@dataclass(frozen=True)
class Measured:
    what: str
    measured: float | None      # None where no counter can see it
    predicted: float
    counter: str = ""           # what measured it
    unit: str = ""              # "bytes", "s", "" (a count)

    @property
    def ratio(self) -> float | None:
        if self.measured is None or not self.predicted:
            return None
        return self.measured / self.predicted

    def close(self, rel: float) -> bool:
        """measured within `rel` of predicted (False when nothing was measured)."""
        return self.ratio is not None and abs(self.ratio - 1) <= rel


COLUMNS = [("what", "what"), ("measured", "measured", ",.6g"), ("predicted", "predicted", ",.6g"),
           ("ratio", "ratio", ".3f"), ("unit", "unit"), ("counter", "counter")]


def measured_table(rows, *, title: str | None = None, indent: str = "") -> str:
    """The rows through labkit.table, one column per field and the ratio."""
    return table([{"what": r.what, "measured": r.measured, "predicted": r.predicted,
                   "ratio": r.ratio, "unit": r.unit, "counter": r.counter} for r in rows],
                 COLUMNS, title=title, indent=indent)
