"""Each calculator's controls are written once (labkit.widgets.controls): the notebook's ipywidgets
and the website's HTML controls (labkit.widgets.web) show the same labels, ranges and defaults."""
from __future__ import annotations

import pytest

from labkit.widgets import (
    checkpoint,
    context,
    ddp,
    intro,
    memory,
    moe,
    pipeline,
    planner,
    precision,
    roofline,
    tp,
    web,
)
from labkit.widgets.controls import check, live, rng

NOTEBOOK = {"intro": intro.calculator, "roofline": roofline.calculator, "ddp": ddp.calculator,
            "memory": memory.calculator, "tp": tp.calculator, "pipeline": pipeline.calculator,
            "checkpoint": checkpoint.calculator, "activations": context.activation_calculator,
            "context-comm": context.comm_calculator, "moe": moe.calculator,
            "precision": precision.bytes_widget, "planner": planner.planner}


def _shown(widget, seen: dict) -> dict:
    """{description: widget} of every control under widget (children, interactive's kwargs)."""
    if getattr(widget, "description", "") and hasattr(widget, "value"):
        seen[widget.description] = widget
    for child in getattr(widget, "children", ()):
        _shown(child, seen)
    return seen


def test_every_web_calculator_has_its_notebook_widget():
    assert set(NOTEBOOK) == set(web.CALCULATORS)


@pytest.mark.parametrize("key", sorted(NOTEBOOK))
def test_the_notebook_widget_shows_the_website_controls(key, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: shown.extend(a))
    top = NOTEBOOK[key]()
    widgets = {}
    for w in [top, *shown]:
        if w is not None:
            _shown(w, widgets)
    for c in web.CALCULATORS[key].controls:
        assert c["label"] in widgets, f"{key}: the notebook has no control {c['label']!r}"
        got, want = widgets[c["label"]].value, c["value"]
        assert got == (pytest.approx(want) if isinstance(want, float) else want), \
            (key, c["name"], got, want)
        if c["kind"] == "select":
            values = [v for _, v in widgets[c["label"]].options]
            assert [v for _, v in c["options"]] == values[:len(c["options"])], (key, c["name"])
        elif c["kind"] in ("range", "log"):
            w = widgets[c["label"]]
            assert (w.min, w.max) == (c["min"], c["max"]), (key, c["name"])


def test_live_draws_at_once_and_again_on_every_change():
    drawn = []
    box = live([rng("n", "n", 1, 8, 1, 2), check("on", "on", False)],
               lambda **v: drawn.append(v), rows=(2,))
    assert drawn == [{"n": 2, "on": False}]
    row, _ = box.children
    row.children[0].value = 5
    assert drawn[-1] == {"n": 5, "on": False} and len(row.children) == 2
