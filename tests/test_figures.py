"""Figures a reader sees: every labels sits on the axis scale plotly draws it on.

On a log axis plotly places annotations at log10(value) but shapes and traces at value, so a label
written as `annotation_text=` of an hline/vline lands at 10**value and the autorange runs off to
1e100 (seen in a real browser on chapter 00's memory figure and chapter 06's waste curve)."""
import inspect
import math

import pytest

from labkit.widgets import checkpoint, ddp, intro, memory, pipeline, planner, ring, tp


def _default_figures():
    for mod in (checkpoint, ddp, intro, memory, pipeline, planner, ring, tp):
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__ or not name.endswith("_figure"):
                continue
            params = inspect.signature(fn).parameters.values()
            if all(p.default is not inspect.Parameter.empty for p in params):
                yield f"{mod.__name__.rsplit('.', 1)[1]}.{name}", fn


FIGURES = dict(_default_figures())
FIGURES["checkpoint.waste_figure"] = lambda: checkpoint.waste_figure(11.1, 155.5 * 3600, 600, 1800)
FIGURES["intro.memory_figure(log=False)"] = lambda: intro.memory_figure("llama2-7b", log=False)


def _axis_values(fig, letter: str) -> list:
    vals = []
    for tr in fig.data:
        data = getattr(tr, letter, None)
        vals += [float(v) for v in ([] if data is None else data)
                 if isinstance(v, (int, float)) and v > 0]
    for sh in fig.layout.shapes:
        if getattr(sh, f"{letter}ref") in (letter, None):
            vals += [v for v in (getattr(sh, f"{letter}0"), getattr(sh, f"{letter}1"))
                     if isinstance(v, (int, float)) and v > 0]
    return vals


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_labels_on_log_axes_are_placed_in_log10_units(name):
    fig = FIGURES[name]()
    for letter in ("x", "y"):
        axis = getattr(fig.layout, f"{letter}axis")
        if axis.type != "log":
            continue
        vals = _axis_values(fig, letter)
        lo, hi = math.log10(min(vals)), math.log10(max(vals))
        for ann in fig.layout.annotations:
            if getattr(ann, f"{letter}ref") in (letter, None) and getattr(ann, letter) is not None:
                pos = getattr(ann, letter)
                assert lo - 1 <= pos <= hi + 1, (
                    f"{name}: annotation {ann.text!r} at {letter}={pos} on a log axis whose data "
                    f"span 10^{lo:.1f}..10^{hi:.1f}: give log10 of the position")
    assert fig.data or fig.layout.shapes, f"{name} drew nothing"


def _walk(widget):
    yield widget
    for child in getattr(widget, "children", ()):
        yield from _walk(child)


def test_memory_calculator_shows_its_controls():
    """Hiding the custom-model fields must not hide the others (a Layout shared by every control
    once hid all of them in the browser, leaving two)."""
    box = memory.calculator()
    controls = [w for w in _walk(box) if hasattr(w, "description") and w.description]
    shown = [w.description for w in controls if w.layout.display != "none"]
    for name in ("model", "micro-batch", "DP degree", "ZeRO stage", "precision", "GPU"):
        assert name in shown, f"{name} hidden; shown: {shown}"
    assert len({id(w.layout) for w in controls}) == len(controls), "controls share a Layout"


# ----------------------------------------------------------------- the crossover labs' figures
# Sweeps shaped like the chapters' saved ones (02, 03, 04, 07): the figure functions read only these
# keys. A crossover far beyond the sweep (1e6) must not stretch the axis either.
_T = [8, 16, 32, 64, 128, 256]


def _ddp_res(far=False):
    steps = [dict(tokens=t, step=0.07 + t * 5e-4, backward=0.04 + t * 4e-4, comm=0.045 + t * 2e-4,
                  comm_model=0.036, step_model=0.038 + t * 5e-4) for t in _T]
    return dict(steps=steps, nproc=2, predicted_tokens=1e6 if far else 86.3,
                measured_tokens=35.0)


def _zero3_res(far=False):
    steps = [dict(tokens=t, comm=2.7 / (t / 16) ** 0.4, compute=1.0, comm_model=6.0 * 16 / t,
                  compute_model=1.0) for t in (16, 64, 256)]
    return dict(steps=steps, nproc=2, predicted_tokens=96.0, measured_tokens=1e7 if far else 210.0)


def _rows_res(x, far=False):
    rows = [{x: v, "ratio": 5.4 * (32 / v) ** 1.5, "ratio_model": 13.6 * (32 / v) ** 2}
            for v in (32, 64, 128, 256, 512)]
    return {"rows": rows, "nproc": 2, "tokens": 1024, f"predicted_{x}": 127.6,
            f"measured_{x}": 1e-4 if far else 152.2}


def _crossover_figures():
    from labkit.labs import overlap, overlap_cp, overlap_tp, overlap_zero3
    for far in (False, True):
        yield f"overlap far={far}", overlap.figure(_ddp_res(far))
        yield f"overlap_zero3 far={far}", overlap_zero3.figure(_zero3_res(far))
        yield f"overlap_tp far={far}", overlap_tp.figure(_rows_res("width", far))
        yield f"overlap_cp far={far}", overlap_cp.figure(_rows_res("chunk", far))


def _data_extent(fig: dict, letter: str):
    vals = [v for tr in fig["data"] for v in tr.get(letter, ()) if isinstance(v, (int, float))
            and v > 0]
    return math.log10(min(vals)), math.log10(max(vals))


def test_crossover_figures_frame_their_data_on_log_axes():
    """The figure JSON of chapters 02, 03, 04 and 07's crossover plots: no annotation placed in
    data units on a log axis (it once sat at x = 86 on a log axis, i.e. 10^86, and the autorange
    ran to 1e113), the x range in log10 units holding the swept points with the data at least
    half of it, every crossover named in the legend (the lines are traces, not annotations)."""
    for name, f in _crossover_figures():
        fig = f.to_dict()
        lay = fig["layout"]
        assert lay["xaxis"]["type"] == "log" and lay["yaxis"]["type"] == "log", name
        for ann in lay.get("annotations", ()):
            assert ann.get("xref") == "paper" or abs(ann.get("x", 0)) < 20, (name, ann)
        sweep = [v for v in fig["data"][0]["x"]]
        lo, hi = math.log10(min(sweep)), math.log10(max(sweep))
        a, b = lay["xaxis"]["range"]
        assert a <= lo and hi <= b, f"{name}: x range {a:.2f}..{b:.2f} cuts the sweep"
        assert (hi - lo) / (b - a) >= 0.2, f"{name}: the sweep fills {(hi - lo) / (b - a):.0%}"
        names = [tr.get("name", "") for tr in fig["data"]]
        for which in ("predicted", "measured"):
            assert any(n.startswith(which) and ":" in n for n in names), (name, which, names)
        if "far=True" in name:
            assert any("off the plot" in n for n in names), (name, names)
        dlo, dhi = _data_extent(fig, "y")
        assert dhi > dlo, name
        assert "width" not in lay, f"{name}: a fixed width does not fit a phone"
