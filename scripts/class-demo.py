"""Twenty copies of chapter 00 as a class might hand them in (README: grading at class scale).

    python scripts/class-demo.py submissions/
    labkit grade submissions/ --csv scores.csv --cell-timeout 30

8 solved, 4 untouched, 3 that average each rank's mean over its own rows (wrong when the shards
differ in size), 2 with an infinite loop, one os._exit, one printing 50 MB, one sys.exit(1).
The edits are made to the solution's source text: if the solution changes, the asserts say so.
"""
import json
import shutil
import sys
from pathlib import Path

from labkit.exercises import exercise_name

ROOT = Path(__file__).resolve().parents[1]
NAME = "00_why_distribute.ipynb"


def variant(solution: dict, old: str = "", new: str = "") -> dict:
    nb = json.loads(json.dumps(solution))
    hits = 0
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
            source = "".join(cell["source"])
            if old and old in source:
                hits += 1
                source = source.replace(old, new)
            cell["source"] = source
    assert hits == (1 if old else 0), f"the solution no longer contains {old!r}"
    return nb


def main(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    solution = json.loads((ROOT / "solutions" / NAME).read_text())
    untouched = json.loads((ROOT / "exercises" / exercise_name(NAME)).read_text())
    shard_mean = ("part = self.loss_fn(self.model(xm), ym) * ((b - a) / B)",
                  "part = self.loss_fn(self.model(xm), ym) * ((b - a) / (hi - lo) / self.world)")
    loop = ("    out = torch.empty_like(x)",
            "    while True:\n        pass\n    out = torch.empty_like(x)")
    before = "def shift_right(x):"
    copies = {f"solved{i}": variant(solution) for i in range(8)}
    copies.update({f"untouched{i}": untouched for i in range(4)})
    copies.update({f"shardmean{i}": variant(solution, *shard_mean) for i in range(3)})
    copies.update({f"hang{i}": variant(solution, *loop) for i in range(2)})
    copies["crash"] = variant(solution, before, "import os\nos._exit(3)\n" + before)
    copies["flood"] = variant(solution, before, "print('x' * 50_000_000)\n" + before)
    copies["sysexit"] = variant(solution, before, "import sys\nsys.exit(1)\n" + before)
    for who, nb in copies.items():
        (out / f"{who}_{NAME}").write_text(json.dumps(nb))
    print(f"{len(copies)} notebooks in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "submissions"))
