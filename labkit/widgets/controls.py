"""A calculator's controls as data, written once: the notebook's ipywidgets and the website's HTML
controls (labkit.widgets.web) are both built from the same list.

    CONTROLS = [sel("model", "model", list(models.PRESETS), "llama2-7b"),
                rng("dp", "GPUs (dp)", 1, 64, 1, 8),            # an integer slider
                rng("overlap", "overlap", 0, 1, 0.05, 0.0),     # a float slider
                logrng("n_params_b", "params (B)", -1, 3, 0.1, 70),  # over log10(value)
                check("sp", "sequence parallel", False)]
    ws = build(CONTROLS)                  # {name: ipywidget}, in the list's order
    values(ws)                            # {name: value}: what the text function takes
    live(CONTROLS, lambda **v: print(summary(**v)))   # the controls over an output, redrawn

A range whose min, step and value are integers is an integer slider (in the notebook and in the
browser, labkit.widgets.web.from_inputs); a log range's min, max and step are exponents of 10
(ipywidgets' FloatLogSlider). Pure data until build() is called, so the website's Pyodide, which
has no ipywidgets, imports the lists.
"""
from __future__ import annotations


def rng(name, label, lo, hi, step, value):
    return {"kind": "range", "name": name, "label": label, "min": lo, "max": hi, "step": step,
            "value": value}


def logrng(name, label, lo, hi, step, value):
    """A slider over log10(value) (ipywidgets' FloatLogSlider): lo, hi, step are exponents."""
    return {"kind": "log", "name": name, "label": label, "min": lo, "max": hi, "step": step,
            "value": value}


def sel(name, label, options, value):
    """options: values, or (label, value) pairs."""
    pairs = [o if isinstance(o, tuple) else (str(o), o) for o in options]
    return {"kind": "select", "name": name, "label": label, "value": value,
            "options": [[str(lab), v] for lab, v in pairs]}


def check(name, label, value):
    return {"kind": "check", "name": name, "label": label, "value": value}


def is_int(c: dict) -> bool:
    """An integer range: its min, step and value are ints."""
    return all(isinstance(c[k], int) and not isinstance(c[k], bool)
               for k in ("min", "step", "value"))


def widget(c: dict, style: dict | None = None, layout=None):
    """The ipywidget for one control, with its label as description."""
    import ipywidgets as w  # optional here: the website's Pyodide reads the data, never this

    kw = {"description": c["label"], "style": style or {"description_width": "initial"}}
    if layout is not None:
        kw["layout"] = layout
    if c["kind"] == "check":
        return w.Checkbox(value=c["value"], indent=False, **kw)
    if c["kind"] == "select":
        return w.Dropdown(options=[(lab, v) for lab, v in c["options"]], value=c["value"], **kw)
    if c["kind"] == "log":
        return w.FloatLogSlider(value=c["value"], base=10, min=c["min"], max=c["max"],
                                step=c["step"], **kw)
    slider = w.IntSlider if is_int(c) else w.FloatSlider
    return slider(value=c["value"], min=c["min"], max=c["max"], step=c["step"], **kw)


def build(controls: list, style: dict | None = None, layout=None) -> dict:
    """{name: ipywidget} for a list of controls, in order (layout: a callable giving each its
    own ipywidgets Layout, or None)."""
    return {c["name"]: widget(c, style, layout() if layout else None) for c in controls}


def values(ws: dict) -> dict:
    return {name: x.value for name, x in ws.items()}


def on_change(ws: dict, fn) -> None:
    """Call fn() whenever any of the widgets changes value."""
    for x in ws.values():
        x.observe(lambda change: fn(), names="value")


def live(controls: list, draw, rows=None):
    """The controls over an ipywidgets Output that draw(**values) fills, cleared and drawn again
    on every change; rows: how many controls each row holds (None: one control per line)."""
    import ipywidgets as w  # optional here: the website's Pyodide reads the data, never this

    ws = build(controls)
    out = w.Output()

    def redraw():
        with out:
            out.clear_output(wait=True)
            draw(**values(ws))

    on_change(ws, redraw)
    redraw()
    items = list(ws.values())
    if rows is not None:
        ends = [sum(rows[:i]) for i in range(len(rows) + 1)]
        items = [w.HBox(items[a:b]) for a, b in zip(ends, ends[1:])]
    return w.VBox([*items, out])
