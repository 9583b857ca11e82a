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
