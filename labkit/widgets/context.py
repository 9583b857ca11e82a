"""Chapter 07 views: activation memory by recomputation and split, and TP / SP / CP communication.

    from labkit.widgets import context as view
    view.activation_figure(s=8192, b=1, h=8192, a=64, tp=8, cp=1)   # stacked bars, GB per layer
    view.comm_figure(b=1, s=8192, h=8192, kv=1024)                  # bytes per layer vs degree
    view.activation_calculator(); view.comm_calculator()           # sliders over the same
    view.measured_figure(rows)                                      # the lab's hooks vs formula
    view.layout_figure(T=16, cp=4)                                  # plain vs zig-zag tokens

Every number comes from labkit.costs.context (Korthikanti et al.'s formulas, 16-bit): a widget, a
worked answer and a checker can never disagree.
"""
from __future__ import annotations

from labkit.costs import context as cc
from labkit.widgets.controls import live, rng, sel

COLOURS = {"replicated": "#4C78A8", "tensor-parallel": "#F58518", "scores": "#E45756",
           "layer input": "#54A24B"}
BARS = [(False, "none"), (True, "none"), (True, "selective"), (True, "full")]


def _bar_name(tp, sp, rc):
    split = f"TP {tp}" + (" + SP" if sp else "")
    return split + {"none": "", "selective": ", selective", "full": ", full recompute"}[rc]


def _parts(s, b, h, a, tp, sp, cp, rc) -> dict:
    """The stacked bar's parts (bytes) for one configuration; their sum is cc.activation_bytes."""
    if rc == "full":
        return {"layer input": cc.activation_bytes(s, b, h, a, tp=tp, sp=sp, cp=cp,
                                                   recompute="full")}
    parts = cc.activation_terms(s, b, h, a, tp=tp, sp=sp, cp=cp)
    if rc == "selective":
        parts["scores"] = 0.0
    return parts


def activation_figure(s: int, b: int, h: int, a: int, tp: int = 8, cp: int = 1):
    """Stacked bars, GB per layer per rank: TP, TP+SP, +selective, +full (sp needs tp > 1)."""
    import plotly.graph_objects as go

    bars = [(sp and tp > 1, rc) for sp, rc in BARS]
    names = [_bar_name(tp, sp, rc) for sp, rc in bars]
    parts = [_parts(s, b, h, a, tp, sp, cp, rc) for sp, rc in bars]
    fig = go.Figure()
    for key, colour in COLOURS.items():
        fig.add_bar(x=names, y=[p.get(key, 0.0) / 1e9 for p in parts], name=key,
                    marker_color=colour)
    fig.update_layout(barmode="stack", height=360, yaxis_title="GB per layer per rank (1e9 B)",
                      title=f"activations of one layer: s={s}, b={b}, h={h}, a={a}, tp={tp}, "
                            f"cp={cp}, 16-bit")
    return fig


def comm_figure(b: int, s: int, h: int, kv: int, degrees=(2, 4, 8, 16), bytes_per_element=2):
    """Bytes one rank sends per layer (forward + backward) at each degree, four methods."""
    import plotly.graph_objects as go

    rows = {d: cc.comm_table(b, s, h, kv, d, bytes_per_element) for d in degrees}
    fig = go.Figure()
    for i, name in enumerate(r[0] for r in rows[degrees[0]]):
        fig.add_scatter(x=list(degrees), y=[rows[d][i][3] / 1e9 for d in degrees],
                        mode="lines+markers", name=name)
    fig.update_layout(height=360, xaxis_title="degree (tp or cp)", xaxis_type="log",
                      yaxis_title="GB sent per layer per rank",
                      title=f"communication per layer: b={b}, s={s}, h={h}, kv={kv}")
    return fig


def measured_figure(rows):
    """The lab's rows (labkit.labs.context.activation_rows): bars measured, markers formula."""
    import plotly.graph_objects as go

    x = [r["case"] for r in rows]
    fig = go.Figure([go.Bar(x=x, y=[r["measured"] / 1e3 for r in rows],
                            name="measured (saved-tensor hooks)", marker_color="#4C78A8"),
                     go.Scatter(x=x, y=[r["predicted"] / 1e3 for r in rows], mode="markers",
                                marker=dict(size=14, symbol="x", color="#E45756"),
                                name="formula (labkit.costs.activations)")])
    fig.update_layout(height=360, yaxis_title="kB one block keeps for backward",
                      title="activation bytes per block, rank 0: measured vs formula")
    return fig


def activation_text(s: int, b: int, h: int, a: int, tp: int = 8, cp: int = 1) -> str:
    """activation_figure's bars as text, GB per layer per rank (the website's calculator)."""
    lines = []
    for sp, rc in [(sp and tp > 1, rc) for sp, rc in BARS]:
        parts = _parts(s, b, h, a, tp, sp, cp, rc)
        lines.append(f"{_bar_name(tp, sp, rc):<28} {sum(parts.values()) / 1e9:8.3f} GB  ("
                     + ", ".join(f"{k} {v / 1e9:.3f}" for k, v in parts.items() if v) + ")")
    return "\n".join(lines)


def comm_text(b: int, s: int, h: int, kv: int, degrees=(2, 4, 8, 16), bytes_per_element=2) -> str:
    """comm_figure's points as text: GB one rank sends per layer, per method and degree."""
    rows = {d: cc.comm_table(b, s, h, kv, d, bytes_per_element) for d in degrees}
    head = f"{'GB per layer per rank':<32}" + "".join(f"{f'degree {d}':>11}" for d in degrees)
    return "\n".join([head] + [f"{name:<32}"
                              + "".join(f"{rows[d][i][3] / 1e9:11.3f}" for d in degrees)
                              for i, name in enumerate(r[0] for r in rows[degrees[0]])])


ACTIVATION_CONTROLS = [rng("s", "s (tokens)", 1024, 131072, 1024, 8192),
                       rng("b", "b", 1, 16, 1, 1),
                       rng("h", "h", 1024, 16384, 512, 8192),
                       rng("a", "a (heads)", 8, 128, 8, 64),
                       sel("tp", "tp", [1, 2, 4, 8], 8),
                       sel("cp", "cp", [1, 2, 4, 8, 16], 1)]


def activation_calculator():
    """Sliders: s, b, h, a, t, cp; the stacked bar and the totals."""
    return live(ACTIVATION_CONTROLS, lambda **v: activation_figure(**v).show(), rows=(3, 3))


COMM_CONTROLS = [rng("b", "b", 1, 16, 1, 1),
                 rng("s", "s (tokens)", 1024, 131072, 1024, 8192),
                 rng("h", "h", 1024, 16384, 512, 8192),
                 rng("kv", "kv (= Hk d)", 128, 16384, 128, 1024)]


def comm_calculator():
    """Sliders: b, s, h, kv; bytes per layer of TP, TP+SP, ring CP and all-gather CP."""
    return live(COMM_CONTROLS, lambda **v: comm_figure(**v).show(), rows=(len(COMM_CONTROLS),))


def layout_figure(T: int = 16, cp: int = 4):
    """Which rank holds each token (plain vs zig-zag), and the causal work each rank gets."""
    from plotly.subplots import make_subplots

    # here: the website's Pyodide has no torch; only the notebook path needs it
    from labkit.context.layout import causal_work, positions

    fig = make_subplots(1, 2, column_widths=[0.65, 0.35], subplot_titles=(
        f"owner of each token, T={T}, cp={cp}", "causal score entries per rank"))
    palette = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#FF9DA6",
               "#9D755D"]
    for row, layout in enumerate(("plain", "zigzag")):
        for r in range(cp):
            pos = positions(T, r, cp, layout).tolist()
            fig.add_bar(x=[1] * len(pos), base=pos, y=[layout] * len(pos), orientation="h",
                        marker_color=palette[r % 8], name=f"rank {r}", showlegend=row == 0,
                        row=1, col=1)
        work = causal_work(T, cp, layout)
        fig.add_bar(x=[f"rank {r}" for r in range(cp)], y=work, name=layout,
                    marker_color=["#999999", "#333333"][row], row=1, col=2)
    fig.update_layout(barmode="overlay", height=320, xaxis_title="token position")
    return fig
