"""The website's calculators: the notebook calculators' controls as data, and their text.

Each entry names the chapter cell whose widget it stands for (its source; the chapter is the one
whose `calculators` name it in the manifest, labkit.chapters), the HTML
controls to draw (a range, a log range, a select or a checkbox, with the notebook widget's
defaults), and the function that turns the controls' values into text: the same text function
the notebook widget prints (intro.summary, moe.summary, precision.bytes_text, ...), so a number
on the website cannot disagree with the widget or with a worked answer.

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
from labkit.costs import checkpoint as ck
from labkit.costs import comm, memory, models
from labkit.costs import planner as P
from labkit.widgets import checkpoint, context, ddp, intro, moe, pipeline, planner, precision, tp
from labkit.widgets import memory as memview
from labkit.widgets import roofline as roofview


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


@dataclass(frozen=True)
class Calculator:
    source: str      # the cell's source (stripped) whose widget output this replaces
    controls: list
    text: object     # values (dict by control name) -> str


def _memory_text(v):
    p = memview.configuration(models.preset(v["model"]), v["seq_len"], v["micro_batch"], v["dp"],
                              v["tp"], v["pp"], v["cp"], v["zero_stage"], v["recipe"],
                              v["recompute"], v["sp"], v["offload"], v["attention"])
    return memview.plan_table(p, v["gpu"], v["unit"])


def _planner_text(v):
    v = dict(v)
    top = v.pop("top")
    return planner.summary(*planner.rank(**v), top)


LINK_NAMES = list(comm.LINKS)

CALCULATORS = {
    "intro": Calculator("intro.calculator()", [
        sel("model", "model", list(models.PRESETS), "llama2-7b"),
        sel("recipe", "recipe", list(memory.RECIPES), "mixed"),
        rng("zero_stage", "ZeRO stage", 0, 3, 1, 0),
        rng("dp", "GPUs (dp)", 1, 64, 1, 8)], lambda v: intro.summary(**v)),
    "roofline": Calculator("roofview.calculator()", [
        sel("layer", "layer", list(roofview.LAYERS), "MLP up (matmul)"),
        sel("gpu", "GPU", list(roofview.roofline.CHIPS), "H100 SXM"),
        sel("dtype", "dtype", ["bf16", "fp16", "fp32"], "bf16"),
        rng("batch", "batch", 1, 64, 1, 1),
        sel("seq", "sequence", [1, 128, 512, 2048, 4096, 8192], 512),
        sel("width", "width", [1024, 2048, 4096, 8192, 12288], 4096)],
        lambda v: roofview.verdict(**v)),
    "ddp": Calculator("view.calculator()", [
        rng("compute_ms", "compute ms", 5, 500, 5, 100),
        rng("comm_ms", "comm ms", 0, 200, 1, 10),
        rng("n", "GPUs N", 1, 256, 1, 8),
        rng("overlap", "overlap", 0, 1, 0.05, 0.0),
        rng("accum", "accumulation", 1, 16, 1, 1),
        rng("slowdown", "slowdown s", 0, 0.5, 0.01, ddp.scaling.OVERLAP_SLOWDOWN)],
        lambda v: ddp.summary(**v)),
    "memory": Calculator("mw.calculator()", [
        sel("model", "model", list(models.PRESETS), "llama2-7b"),
        sel("seq_len", "sequence length", [1024, 2048, 4096, 8192, 32768, 131072], 4096),
        rng("micro_batch", "micro-batch", 1, 32, 1, 1),
        sel("recipe", "precision", memview.recipe_options(), "mixed"),
        sel("attention", "attention", [("flash (SDPA, PyTorch's default)", "flash"),
                                       ("eager (s x s scores kept)", "eager")], "flash"),
        sel("recompute", "recompute", list(memory.RECOMPUTE), "selective"),
        check("sp", "sequence parallel (with TP)", False),
        sel("dp", "DP degree", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], 8),
        sel("tp", "TP degree", [1, 2, 4, 8], 1),
        sel("pp", "PP degree", [1, 2, 4, 8, 16], 1),
        sel("cp", "CP degree", [1, 2, 4, 8, 16, 32], 1),
        sel("zero_stage", "ZeRO stage", [("0 (DDP)", 0), ("1: optimizer", 1), ("2: + gradients", 2),
                                         ("3: + parameters (FSDP)", 3)], 1),
        sel("offload", "offload", [("none", 0), ("optimizer -> CPU", 1),
                                   ("optimizer + params -> CPU", 2)], 0),
        sel("gpu", "GPU", list(memory.GPUS), "H100 80GB"),
        sel("unit", "unit", ["GB", "GiB"], "GB")], _memory_text),
    "tp": Calculator("view.calculator()", [
        rng("b", "b", 1, 32, 1, 1),
        rng("s", "s", 256, 32768, 256, 4096),
        rng("h", "h", 1024, 16384, 1024, 8192),
        sel("tp", "TP", [1, 2, 4, 8, 16], 8),
        sel("link", "link", LINK_NAMES, "NVLink 4 (H100 SXM)")], lambda v: tp.summary(**v)),
    "pipeline": Calculator("pw.calculator()", [
        sel("schedule", "schedule", list(pipeline.ALL_SCHEDULES), "1f1b"),
        rng("P", "stages P", 1, 8, 1, 4),
        rng("K", "micro-batches K", 1, 32, 1, 8),
        rng("v", "chunks v", 1, 4, 1, 2),
        rng("t_f", "t_f", 0.25, 4.0, 0.25, 1.0),
        rng("t_b", "t_b", 0.25, 8.0, 0.25, 2.0)], lambda v: pipeline.summary(**v)),
    "checkpoint": Calculator("cw.calculator()", [
        logrng("n_params_b", "params (B)", -1, 3, 0.1, 70),
        sel("recipe", "recipe", sorted(ck.RECIPES), "mixed_adam"),
        rng("writers", "writers", 1, 1024, 1, 64),
        rng("per_writer_GBps", "GB/s each", 0.1, 25, 0.1, 2.0),
        rng("storage_GBps", "storage GB/s", 1, 2000, 1, 100),
        logrng("node_mtbf_h", "node MTBF h", 2, 6, 0.1, round(checkpoint.NODE_MTBF_H)),
        rng("nodes", "nodes", 1, 4096, 1, 256),
        rng("restart_min", "restart min", 0, 60, 0.1, 10),
        rng("interval_min", "interval min", 1, 600, 0.1, 30)],
        lambda v: checkpoint.plan_table(checkpoint.plan(**v))),
    "activations": Calculator("view.activation_calculator()", [
        rng("s", "s (tokens)", 1024, 131072, 1024, 8192),
        rng("b", "b", 1, 16, 1, 1),
        rng("h", "h", 1024, 16384, 512, 8192),
        rng("a", "a (heads)", 8, 128, 8, 64),
        sel("tp", "tp", [1, 2, 4, 8], 8),
        sel("cp", "cp", [1, 2, 4, 8, 16], 1)], lambda v: context.activation_text(**v)),
    "context-comm": Calculator("view.comm_calculator()", [
        rng("b", "b", 1, 16, 1, 1),
        rng("s", "s (tokens)", 1024, 131072, 1024, 8192),
        rng("h", "h", 1024, 16384, 512, 8192),
        rng("kv", "kv (= Hk d)", 128, 16384, 128, 1024)], lambda v: context.comm_text(**v)),
    "moe": Calculator("view.calculator()", [
        sel("n_expert", "experts", [4, 8, 16, 32, 64, 128, 256], 8),
        rng("k", "top-k", 1, 8, 1, 2),
        rng("factor", "capacity", 0.25, 3.0, 0.25, 1.25),
        sel("ep", "ep", [1, 2, 4, 8, 16, 32, 64], 8),
        sel("tokens_per_gpu", "tokens/GPU", [1024, 4096, 8192, 16384], 8192),
        sel("bandwidth", "link", [("NVLink 450 GB/s", 450e9), ("InfiniBand 50 GB/s", 50e9),
                                  ("Ethernet 12.5 GB/s", 12.5e9)], 50e9)],
        lambda v: moe.summary(**v)),
    "precision": Calculator("view.bytes_widget(7e9)", [
        logrng("n_params", "params (B)", -1, 3, 0.05, 7),
        sel("weights", "weights", ["bf16", "fp16", "fp8", "fp32"], "bf16"),
        sel("grads", "grads", ["bf16", "fp16", "fp32"], "bf16"),
        check("master", "fp32 master copy", True),
        sel("moments", "Adam moments", ["fp32", "bf16"], "fp32")],
        lambda v: precision.bytes_text(**{**v, "n_params": v["n_params"] * 1e9})),
    "planner": Calculator("pw.planner()", [
        sel("model", "model", list(models.PRESETS), "llama2-70b"),
        sel("n_gpus", "GPUs", [8, 16, 32, 64, 128, 256, 512, 1024], 128),
        sel("gpus_per_node", "GPUs per node", [4, 8], 8),
        sel("gpu", "GPU", list(memory.GPUS), "A100 80GB"),
        sel("intra", "intra-node link", LINK_NAMES, "NVLink 3 (A100 SXM)"),
        sel("inter", "inter-node link", LINK_NAMES, "InfiniBand HDR 200 Gb/s"),
        sel("global_batch", "global batch", [256, 512, 1024, 1536, 2048], 1024),
        sel("seq_len", "sequence length", [1024, 2048, 4096, 8192, 32768, 131072], 4096),
        sel("recipe", "recipe", list(memory.RECIPES), "mixed"),
        sel("recompute", "recompute", [("none", "none"), ("full (chapter 06)", "full"),
                                       ("selective (chapter 07)", "selective")], "none"),
        check("sequence_parallel", "sequence parallel (chapter 07)", False),
        sel("grad_reduce", "gradient reduction", [("fp32 (Megatron, torchtitan, Llama 3)", "fp32"),
                                                  ("bf16 (half the bytes)", "bf16")], "fp32"),
        check("overlap_param_gather", "ZeRO-1/2 gather under the next forward", False),
        rng("overlap", "overlap", 0.0, 1.0, 0.05, 0.5),
        rng("margin", "memory margin", 0.0, 0.3, 0.01, 0.10),
        rng("efficiency", "kernel efficiency", 0.2, 0.8, 0.05, 0.5),
        logrng("mtbf_h", "GPU MTBF h", 3, 6, 0.1, P.LLAMA3_GPU_MTBF_H),
        rng("top", "rows shown", 3, 20, 1, 8)], _planner_text),
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


def _is_int(c) -> bool:
    return all(isinstance(c[k], int) and not isinstance(c[k], bool)
               for k in ("min", "step", "value"))


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
            x = int(round(float(x))) if _is_int(c) else float(x)
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
