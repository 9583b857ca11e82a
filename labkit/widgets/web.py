"""The website's calculators: the notebook calculators' controls (as data) and their text.

Each entry names the chapter cell whose widget it stands for (its source; the chapter is the one
whose `calculators` name it in the manifest, labkit.chapters), the controls to draw (the widget
module's CONTROLS, labkit.widgets.controls: the same list the notebook's ipywidgets are built
from, so their ranges and defaults cannot differ), and the function that turns the controls'
values into text: the same text function the notebook widget prints (intro.summary,
moe.summary, precision.bytes_text, ...), so a number on the website cannot disagree with the
widget or with a worked answer.

The site (labkit.site) draws the controls and prints render(key, defaults) into the page at build
time; in the reader's browser Pyodide imports this module and calls render(key, values) on every
change. Everything it imports is pure Python (labkit.costs, labkit.pipeline's schedules and
simulator, the widget modules' text functions): no torch, numpy, plotly or ipywidgets.
"""
from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass

from labkit import chapters
from labkit.costs import models
from labkit.widgets import checkpoint, context, ddp, intro, moe, pipeline, planner, precision, tp
from labkit.widgets import memory as memview
from labkit.widgets import roofline as roofview
from labkit.widgets.controls import is_int


@dataclass(frozen=True)
class Calculator:
    source: str      # the cell's source (stripped) whose widget output this replaces
    controls: list
    text: object     # values (dict by control name) -> str


def _memory_text(v):
    p = memview.configuration(models.preset(v["model"]), v["seq_len"], v["micro_batch"], v["dp"],
                              v["tp"], v["pp"], v["cp"], v["zero"], v["recipe"],
                              v["recompute"], v["sp"], v["offload"], v["attention"])
    return memview.plan_table(p, v["gpu"], v["unit"])


def _planner_text(v):
    v = dict(v)
    top = v.pop("top")
    return planner.summary(*planner.rank(**v), top)


CALCULATORS = {   # each widget module's CONTROLS: the notebook's ipywidgets are built from them
    "intro": Calculator("intro.calculator()", intro.CONTROLS, lambda v: intro.summary(**v)),
    "roofline": Calculator("roofview.calculator()", roofview.CONTROLS,
                           lambda v: roofview.verdict(**v)),
    "ddp": Calculator("view.calculator()", ddp.CONTROLS, lambda v: ddp.summary(**v)),
    "memory": Calculator("mw.calculator()", memview.CONTROLS, _memory_text),
    "tp": Calculator("view.calculator()", tp.CONTROLS, lambda v: tp.summary(**v)),
    "pipeline": Calculator("pw.calculator()", pipeline.CONTROLS, lambda v: pipeline.summary(**v)),
    "checkpoint": Calculator("cw.calculator()", checkpoint.CONTROLS,
                             lambda v: checkpoint.plan_table(checkpoint.plan(**v))),
    "activations": Calculator("view.activation_calculator()", context.ACTIVATION_CONTROLS,
                              lambda v: context.activation_text(**v)),
    "context-comm": Calculator("view.comm_calculator()", context.COMM_CONTROLS,
                               lambda v: context.comm_text(**v)),
    "moe": Calculator("view.calculator()", moe.CONTROLS, lambda v: moe.summary(**v)),
    "precision": Calculator("view.bytes_widget(7e9)", precision.CONTROLS,
                            lambda v: precision.bytes_text(
                                **{**v, "n_params": v["n_params"] * 1e9})),
    "planner": Calculator("pw.planner()", planner.CONTROLS, _planner_text),
}


def chapter_of(key: str) -> str:
    """"08": the number of the chapter whose notebook shows calculator `key` (labkit.chapters)."""
    c = chapters.chapter_of_calculator(key)
    if c is None:
        raise KeyError(f"calculator {key!r} is in no chapter's `calculators` in labkit.chapters")
    return c.nn


def find(chapter: str, source: str):
    """The key of the calculator standing for this chapter cell, or None: one of the chapter's
    calculators in the manifest (labkit.chapters) whose cell source this is."""
    try:
        keys = chapters.chapter(int(chapter)).calculators
    except (KeyError, ValueError):
        return None
    return next((k for k in keys if k in CALCULATORS
                 and CALCULATORS[k].source == source.strip()), None)


def defaults(key: str) -> dict:
    return {c["name"]: c["value"] for c in CALCULATORS[key].controls}


def from_inputs(key: str, raw) -> dict:
    """Values from the page's inputs as the browser holds them (a dict or its JSON): a log range
    sends its exponent (10 ** x is taken here, in Python, as ipywidgets' FloatLogSlider does), an
    integer range its number as a float."""
    raw = json.loads(raw) if isinstance(raw, str) else raw
    out = {}
    for c in CALCULATORS[key].controls:
        if c["name"] not in raw:
            continue
        x = raw[c["name"]]
        if c["kind"] == "log":
            x = 10 ** float(x)
        elif c["kind"] == "range":
            x = int(round(float(x))) if is_int(c) else float(x)
        out[c["name"]] = x
    return out


def render_inputs(key: str, raw) -> str:
    """render() for the page's raw inputs (what the browser calls)."""
    return render(key, from_inputs(key, raw))


def render(key: str, values=None) -> str:
    """The calculator's text for values (a dict or its JSON; missing ones take the defaults).
    A setting the formulas refuse prints the reason, as the notebook widget does."""
    v = defaults(key)
    v.update(json.loads(values) if isinstance(values, str) else values or {})
    try:
        return CALCULATORS[key].text(v)
    except (ValueError, KeyError, ZeroDivisionError) as err:
        return f"cannot compute this setting: {err}"


def _control_html(c: dict) -> str:
    name = f'name="{c["name"]}"'
    label = html.escape(c["label"])
    if c["kind"] == "check":
        return (f'<label class="book-check"><input type="checkbox" {name}'
                f'{" checked" if c["value"] else ""}> {label}</label>')
    if c["kind"] == "select":
        opts = "".join(f'<option value="{html.escape(json.dumps(v))}"'
                       f'{" selected" if v == c["value"] else ""}>{html.escape(lab)}</option>'
                       for lab, v in c["options"])
        return f'<label><span>{label}</span><select {name}>{opts}</select></label>'
    if c["kind"] == "log":  # the slider holds log10(value), as ipywidgets' FloatLogSlider
        lo, hi, value, step = c["min"], c["max"], f'{math.log10(c["value"]):.6g}', "any"
    else:
        lo, hi, value, step = c["min"], c["max"], c["value"], c["step"]
    return (f'<label><span>{label}</span><input type="range" {name} min="{lo}" max="{hi}" '
            f'step="{step}" value="{value}" data-kind="{c["kind"]}"><output></output></label>')


def calculator_html(key: str, note: str) -> str:
    """The website's calculator: its controls (shown once Pyodide runs), its text for the default
    values (computed now, by the same function), and with JavaScript off, the note."""
    controls = "".join(_control_html(c) for c in CALCULATORS[key].controls)
    return (f'<div class="book-calc" data-calc="{key}">'
            f'<form class="book-calc-controls" hidden>{controls}</form>'
            f'<pre class="book-calc-out">{html.escape(render(key))}</pre>'
            f'<p class="book-calc-status">The calculator at its default values: its controls run '
            f'in your browser when the site is served (<code>python -m labkit site serve</code>) '
            f'and JavaScript is on.</p>'
            f'<noscript>{note}</noscript></div>')


def frames_html(fig_div: str, frames: dict, start: int, note: str) -> str:
    """A figure explorer with no Python in the browser: sliders over N and the step switch between
    frames drawn at build time (frames: {N: [plotly JSON strings]}). fig_div: the page's figure
    div for frames[start][0], drawn as every saved figure is."""
    data = "{" + ",".join(f'"{n}":[{",".join(fs)}]' for n, fs in frames.items()) + "}"
    data = data.replace("</", "<\\/")
    lo, hi = min(frames), max(frames)
    return (f'<div class="book-frames">'
            f'<form class="book-calc-controls" hidden>'
            f'<label><span>ranks N</span>'
            f'<input type="range" name="n" min="{lo}" max="{hi}" step="1" '
            f'value="{start}"><output></output></label>'
            f'<label><span>step</span><input type="range" name="step" min="0" '
            f'max="{len(frames[start]) - 1}" step="1" value="0"><output></output></label></form>'
            f'{fig_div}<script type="application/json" class="book-frames-json">{data}</script>'
            f'<noscript>{note}</noscript></div>')
