"""Chapter 03's memory calculator, and the plots of measured ZeRO bytes against the prediction.

    from labkit.widgets import memory as mw
    mw.calculator()                                   # the whole calculator (ipywidgets)
    p = labkit.costs.memory.plan("llama2-7b", recipe="mixed", zero=3, dp=8)
    mw.plan_figure(p, "H100 80GB"); print(mw.plan_table(p))
    mw.measured_figure(rows)                          # rows from labkit.labs.zero.measure.rows
    mw.loss_curves_figure(summary, reference)         # labkit.labs.zero.tracking
    mw.prefetch_figure({"no prefetch": events, ...})  # labkit.labs.zero.overlap.prefetch_lab

Every number comes from labkit.costs.memory / labkit.costs.models, so the calculator, the worked
answers and the checkers can never disagree.
"""
from __future__ import annotations

import textwrap

from labkit.costs import memory, models
from labkit.widgets.controls import build, check, rng, sel, values

UNITS = {"GB": memory.GB, "GiB": memory.GiB}
COLORS = {"params": "#4C78A8", "grads": "#F58518", "optimizer": "#54A24B",
          "activations": "#B279A2", "gathered": "#9D755D"}
CUSTOM = "custom"
ACTIVATION_NOTE = {"fp32": "every saved value 4 bytes",
                   "bf16": "bf16 parameters: every saved value 2 bytes",
                   "autocast": "torch.autocast: fp32 residual stream, bf16 matmul inputs and "
                               "weight copies"}
ATTENTION_NOTE = {"flash": "a fused kernel, PyTorch's SDPA default: no s x s scores",
                  "eager": "the s x s scores kept"}


def recipe_options() -> list:
    """(label, name) for each precision recipe: its bytes per parameter and its activations."""
    return [(f"{r.name}: {r.weights:g}+{r.grads:g}+{r.optimizer:g}={r.total:g} B/param, "
             f"{r.activation_recipe} activations", k) for k, r in memory.RECIPES.items()]


def plan_table(plan: memory.MemoryPlan, gpu="H100 80GB", unit: str = "GB") -> str:
    """The plan's numbers as text, with the GPU's capacity and whether it fits."""
    scale = UNITS[unit]
    cap = memory.gpu_capacity(gpu)
    lines = [f"{label:<24} {value:>10.2f} {unit}" for label, value in plan.rows(unit)]
    verdict = "fits" if plan.fits(cap) else "does NOT fit"
    name = gpu if isinstance(gpu, str) else "custom GPU"
    lines.append(f"{name + ' capacity':<24} {cap / scale:>10.2f} {unit}  -> {verdict} "
                 f"(keeping {100 * memory.MARGIN:.0f}% free: {plan.headroom(cap) / scale:.2f} "
                 f"{unit} left)")
    s = plan.settings
    lines.append(f"model {s['model']}: {s['n_params'] / 1e9:.3f}B parameters; recipe {s['recipe']}")
    lines.append(f"activations as the recipe keeps them: {s['activation_recipe']} "
                 f"({ACTIVATION_NOTE[s['activation_recipe']]}), {s['attention']} attention "
                 f"({ATTENTION_NOTE[s['attention']]})")
    lines.append("(1 GB = 1e9 bytes, 1 GiB = 2^30 bytes)")
    return "\n".join(lines)


def plan_figure(plan: memory.MemoryPlan, gpu="H100 80GB", unit: str = "GB"):
    """One stacked bar: parameters, gradients, optimizer states, activations vs the capacity."""
    import plotly.graph_objects as go

    scale = UNITS[unit]
    cap = memory.gpu_capacity(gpu)
    fig = go.Figure()
    for c in plan.COMPONENTS:
        v = getattr(plan, c) / scale
        if v > 0:
            fig.add_bar(name=plan.LABELS[c], x=["per GPU"], y=[v], marker_color=COLORS[c],
                        hovertemplate=f"{plan.LABELS[c]}: %{{y:.2f}} {unit}<extra></extra>")
    fig.add_hline(y=cap / scale, line_dash="dash", line_color="red",
                  annotation_text=f"{gpu if isinstance(gpu, str) else 'GPU'}: "
                                  f"{cap / scale:.1f} {unit}")
    s = plan.settings
    fits = "fits" if plan.fits(cap) else "does not fit"
    fig.update_layout(barmode="stack", height=420, width=520, legend_orientation="v",
                      yaxis_title=unit, title=f"{s['model']}, ZeRO-{s['zero']}, "
                      f"DP{s['dp']} TP{s['tp']} PP{s['pp']}: {plan.total / scale:.1f} {unit} "
                      f"({fits})", yaxis_range=[0, 1.15 * max(plan.total, cap) / scale])
    return fig


def measured_figure(rows, parts=("params", "grads", "optimizer")):
    """Measured bytes per rank (bars) and the calculator's prediction (markers), per stage and N."""
    import plotly.graph_objects as go

    fig = go.Figure()
    xs = [f"N={r['ranks']}<br>ZeRO-{r['stage']}" for r in rows]
    for part in parts:
        fig.add_bar(name=f"{part} (measured)", x=xs,
                    y=[r[f"{part}_measured"] / 1e3 for r in rows], marker_color=COLORS[part])
    fig.add_scatter(name="predicted total (labkit.costs.memory)", x=xs,
                    y=[r["total_predicted"] / 1e3 for r in rows], mode="markers",
                    marker=dict(symbol="line-ew-open", size=40, line_width=3, color="black"))
    fig.update_layout(barmode="stack", height=420, yaxis_title="KB per rank (1e3 bytes)",
                      title="Bytes each rank keeps after a step: measured vs predicted",
                      legend_orientation="h", legend_y=-0.25)
    return fig


def traffic_figure(rows):
    """Bytes sent per rank per step in units of Ψ values, measured vs 2(N-1)/N and 3(N-1)/N."""
    import plotly.graph_objects as go

    fig = go.Figure()
    xs = [f"N={r['ranks']}<br>ZeRO-{r['stage']}" for r in rows]
    fig.add_bar(name="measured", x=xs, y=[r["sent_in_psi"] for r in rows])
    fig.add_scatter(name="predicted", x=xs, mode="markers",
                    y=[r["sent_predicted"] / r["sent_measured"] * r["sent_in_psi"] for r in rows],
                    marker=dict(symbol="line-ew-open", size=40, line_width=3, color="black"))
    fig.update_layout(height=380, yaxis_title="bytes sent / (bytes per value x Ψ)",
                      title="Traffic per rank per step: 2(N-1)/N Ψ for stages 0-2, 3(N-1)/N Ψ "
                            "for stage 3", legend_orientation="h")
    return fig


def loss_curves_figure(summary, reference):
    """The fp32 reference's loss and each policy's (labkit solid, FSDP2 dotted on top), per step;
    `summary` from labkit.labs.zero.tracking.summary."""
    import plotly.graph_objects as go

    fig = go.Figure()
    steps = list(range(len(reference)))
    fig.add_scatter(x=steps, y=reference, name="fp32, one process", line=dict(color="black"))
    colors = {"bfloat16": "#4C78A8", "float16": "#E45756"}
    for (who, dtype), row in summary.items():
        fig.add_scatter(x=steps, y=row["losses"], name=f"{who} {dtype}",
                        line=dict(color=colors.get(dtype), width=2 if who == "labkit" else 4,
                                  dash="solid" if who == "labkit" else "dot"))
    fig.update_layout(height=400, xaxis_title="step", yaxis_title="global loss",
                      title="ZeRO-3 with mixed-precision policies vs fp32 and vs FSDP2",
                      legend_orientation="h", legend_y=-0.2)
    return fig


def prefetch_figure(events_by_mode):
    """One measured ZeRO-3 step per mode: compute spans (forward, backward) and gathers on a
    comm row under them; events from labkit.labs.zero.overlap.prefetch_lab (ms)."""
    import plotly.graph_objects as go

    colors = {"forward": "#4C78A8", "backward": "#F58518", "prefetch": "#54A24B",
              "gather": "#E45756", "reduce_scatter": "#BAB0AC", "all_reduce": "#BAB0AC"}
    fig, seen, rows = go.Figure(), set(), []
    for mode, events in events_by_mode.items():
        for e in events:
            # a row's name on lines of at most 18 characters: at 390 px (a phone) the plot keeps
            # the width
            row = "<br>".join(textwrap.wrap(
                f"{mode}: {'comm' if e['lane'] == 'comm' else 'compute'}", 18))
            rows.append(row)
            fig.add_trace(go.Bar(
                y=[row], x=[max(e["end"] - e["start"], 1e-3)], base=[e["start"]],
                orientation="h", marker_color=colors.get(e["name"], "#72B7B2"),
                marker_line_width=0.5, name=e["name"], legendgroup=e["name"],
                showlegend=e["name"] not in seen, opacity=0.8,
                hovertext=f"{e['name']} {e.get('unit', '')}: {e['start']:.1f}-{e['end']:.1f} ms"))
            seen.add(e["name"])
    rows = list(dict.fromkeys(rows))
    fig.update_layout(barmode="overlay", height=160 + 48 * len(rows),
                      xaxis_title="ms since the step began", title="One ZeRO-3 step, rank 0",
                      yaxis=dict(categoryorder="array", categoryarray=rows[::-1]),
                      legend_orientation="h", legend_y=-0.3, margin=dict(l=10, r=10, t=50))
    return fig


def configuration(spec, seq_len, micro_batch, dp, tp, pp, cp, zero, recipe, recompute,
                  sequence_parallel, offload, attention: str = "flash") -> memory.MemoryPlan:
    """The calculator's plan for one setting (offload: 0 none, 1 optimizer, 2 optimizer + params;
    attention "flash", PyTorch's default, or "eager"). Raises ValueError with the reason when the
    setting cannot run."""
    if seq_len % (2 * cp):
        raise ValueError(f"CP {cp} cuts the sequence into 2*cp = {2 * cp} zig-zag chunks: use a "
                         f"sequence length divisible by {2 * cp}")
    # CP (chapter 07): each GPU keeps the activations of s/cp tokens, and the cp ranks hold the
    # same weights, so ZeRO shards over dp x cp (as torchtitan does)
    return memory.plan(spec, recipe=recipe, zero=zero, dp=dp * cp, tp=tp, pp=pp,
                       seq_len=seq_len // cp, micro_batch=micro_batch, recompute=recompute,
                       sequence_parallel=sequence_parallel and tp > 1,
                       offload_optimizer=offload >= 1, offload_params=offload == 2,
                       attention=attention)


CONTROLS = [
    sel("model", "model", list(models.PRESETS), "llama2-7b"),
    sel("seq_len", "sequence length", [1024, 2048, 4096, 8192, 32768, 131072], 4096),
    rng("micro_batch", "micro-batch", 1, 32, 1, 1),
    sel("recipe", "precision", recipe_options(), "mixed"),
    sel("attention", "attention", [("flash (SDPA, PyTorch's default)", "flash"),
                                   ("eager (s x s scores kept)", "eager")], "flash"),
    sel("recompute", "recompute", list(memory.RECOMPUTE), "selective"),
    check("sp", "sequence parallel (with TP)", False),
    sel("dp", "DP degree", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], 8),
    sel("tp", "TP degree", [1, 2, 4, 8], 1),
    sel("pp", "PP degree", [1, 2, 4, 8, 16], 1),
    sel("cp", "CP degree", [1, 2, 4, 8, 16, 32], 1),
    sel("zero", "ZeRO stage", [("0 (DDP)", 0), ("1: optimizer", 1), ("2: + gradients", 2),
                                     ("3: + parameters (FSDP)", 3)], 1),
    sel("offload", "offload", [("none", 0), ("optimizer -> CPU", 1),
                               ("optimizer + params -> CPU", 2)], 0),
    sel("gpu", "GPU", list(memory.GPUS), "H100 80GB"),
    sel("unit", "unit", ["GB", "GiB"], "GB")]
LEFT = ("model", "seq_len", "micro_batch", "recipe", "attention", "recompute", "sp")


def calculator():
    """The memory calculator: model, shape, parallelism (DP, TP, PP, CP), ZeRO, precision recipe
    (fp32, autocast, bf16 parameters: what the states cost and what the activations keep),
    attention (flash or eager), recomputation, sequence parallelism, GPU. The notebook adds a
    custom model and a custom GPU to the website's controls (CONTROLS)."""
    import ipywidgets as w
    from IPython.display import display

    style = {"description_width": "110px"}

    def lay():  # one Layout per widget: a shared one would take display="none" to all of them
        return w.Layout(width="330px")

    ctl = build(CONTROLS, style, lay)
    for name in ("model", "gpu"):   # new options reset the value: put the default back
        value = ctl[name].value
        ctl[name].options = list(ctl[name].options) + [(CUSTOM, CUSTOM)]
        ctl[name].value = value
    hidden = w.IntText(4096, description="hidden", style=style, layout=lay())
    layers = w.IntText(32, description="layers", style=style, layout=lay())
    heads = w.IntText(32, description="heads", style=style, layout=lay())
    kv = w.IntText(32, description="kv heads", style=style, layout=lay())
    ffn = w.IntText(11008, description="FFN size", style=style, layout=lay())
    vocab = w.IntText(32000, description="vocabulary", style=style, layout=lay())
    gated = w.Checkbox(True, description="gated MLP (SwiGLU)", indent=False)
    tied = w.Checkbox(False, description="tied embeddings", indent=False)
    custom = [hidden, layers, heads, kv, ffn, vocab, gated, tied]
    custom_box = w.VBox(custom)
    custom_gib = w.FloatText(24.0, description="custom GiB", style=style, layout=lay())
    out = w.Output()

    def spec_now():
        if ctl["model"].value != CUSTOM:
            return models.preset(ctl["model"].value)
        return models.ModelSpec("custom", vocab_size=vocab.value, hidden=hidden.value,
                                n_layers=layers.value, n_heads=heads.value,
                                n_kv_heads=kv.value, ffn_hidden=ffn.value,
                                gated_mlp=gated.value, tied_embeddings=tied.value)

    def update(*_):
        v = values(ctl)
        custom_box.layout.display = "" if v["model"] == CUSTOM else "none"
        custom_gib.layout.display = "" if v["gpu"] == CUSTOM else "none"
        out.clear_output(wait=True)
        with out:
            try:
                p = configuration(spec_now(), v["seq_len"], v["micro_batch"], v["dp"], v["tp"],
                                  v["pp"], v["cp"], v["zero"], v["recipe"], v["recompute"],
                                  v["sp"], v["offload"], v["attention"])
            except (ValueError, KeyError) as err:
                print(f"cannot compute this configuration: {err}")
                return
            g = custom_gib.value * memory.GiB if v["gpu"] == CUSTOM else v["gpu"]
            display(plan_figure(p, g, v["unit"]))
            print(plan_table(p, g, v["unit"]))

    def on_model(change):
        seq = ctl["seq_len"]
        if change["new"] != CUSTOM and models.preset(change["new"]).seq_len in [
                o[1] for o in seq.options]:
            seq.value = models.preset(change["new"]).seq_len
        update()

    ctl["model"].observe(on_model, "value")
    for wd in [x for name, x in ctl.items() if name != "model"] + custom + [custom_gib]:
        wd.observe(update, "value")
    left = w.VBox([ctl["model"], custom_box] + [ctl[n] for n in LEFT[1:]])
    right = w.VBox([ctl[n] for n in ("dp", "tp", "pp", "cp", "zero", "offload", "gpu")]
                   + [custom_gib, ctl["unit"]])
    update()
    return w.VBox([w.HBox([left, right]), out])


def shards_picture(n: int = 4):
    """Who holds what: for each stage, each GPU's parameters, gradients and optimizer states cut
    in N chunks; a filled chunk is held by that GPU, an empty one is not."""
    from plotly.subplots import make_subplots

    titles = ["ZeRO-0 (DDP)", "ZeRO-1: P_os", "ZeRO-2: P_os+g", "ZeRO-3: P_os+g+p"]
    fig = make_subplots(rows=1, cols=4, subplot_titles=titles, horizontal_spacing=0.03)
    widths = {"params": 2, "grads": 2, "optimizer": 12}   # bytes/param, mixed precision
    shapes = []  # built as one list: adding shapes one by one to subplots is slow
    for stage in range(4):
        sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
        axis = "" if stage == 0 else str(stage + 1)
        for gpu in range(n):
            x0 = 0.0
            for part, wdt in widths.items():
                for chunk in range(n):
                    held = (not sharded[part]) or chunk == gpu
                    x1 = x0 + wdt / n
                    shapes.append(dict(type="rect", x0=x0, x1=x1, y0=n - gpu - 0.9,
                                       y1=n - gpu - 0.1, xref=f"x{axis}", yref=f"y{axis}",
                                       line=dict(width=0.5, color="#666"),
                                       fillcolor=COLORS[part] if held else "white"))
                    x0 = x1
        fig.update_xaxes(range=[0, 16], showticklabels=False, row=1, col=stage + 1)
        fig.update_yaxes(range=[0, n], tickvals=[n - g - 0.5 for g in range(n)],
                         ticktext=[f"GPU {g}" for g in range(n)], showticklabels=stage == 0,
                         row=1, col=stage + 1)
    fig.update_layout(shapes=shapes)
    for part, label in (("params", "parameters (2Ψ)"), ("grads", "gradients (2Ψ)"),
                        ("optimizer", "optimizer states (12Ψ)")):
        fig.add_scatter(x=[None], y=[None], mode="markers", name=label,
                        marker=dict(symbol="square", size=12, color=COLORS[part]))
    fig.update_layout(height=300, legend_orientation="h", legend_y=-0.08,
                      title=f"What each of {n} GPUs holds (coloured = held; width = bytes/param)",
                      plot_bgcolor="white")
    return fig
