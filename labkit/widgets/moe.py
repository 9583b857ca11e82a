"""The MoE calculator and the pictures of chapter 08, over labkit.costs.moe.

    from labkit.widgets import moe as view
    view.calculator()                         # sliders: experts, top-k, capacity, ep, ...
    print(view.summary(...))                  # the same numbers as text
    view.load_figure(runs)                    # tokens per expert over steps, per balancing mode
    view.routing_picture()                    # tokens -> router -> experts -> back, as a figure
"""
from __future__ import annotations

from labkit.costs import moe as mc
from labkit.widgets.controls import build, on_change, rng, sel, values


def summary(h=4096, n_layer=32, n_expert=8, k=2, ffn_mult=3.5, ep=8, tokens_per_gpu=8192,
            factor=1.25, bandwidth=50e9, vocab=32000) -> str:
    """Text of the calculator: parameters, memory per GPU, all-to-all bytes and time, drops."""
    r = mc.calculator(h, n_layer, n_expert, k, ffn_mult, ep, tokens_per_gpu, factor, bandwidth,
                      vocab=vocab)
    cap = "no limit" if r["capacity"] is None else f"{r['capacity']:,} assignments per expert"
    return "\n".join([
        f"parameters: {r['total_params'] / 1e9:.2f} B total, {r['active_params'] / 1e9:.2f} B "
        f"active per token ({r['active_params'] / r['total_params']:.0%})",
        f"training FLOPs per token: {r['flops_per_token'] / 1e9:.1f} GFLOP "
        f"(a dense model of the same total size: {r['dense_flops_per_token'] / 1e9:.1f})",
        f"model state per GPU (16 B/param, experts over ep={ep}): {r['memory_bytes'] / 1e9:.1f} GB",
        f"all-to-all per step per GPU (4 per layer, bf16): {r['alltoall_bytes'] / 1e9:.2f} GB "
        f"-> {r['alltoall_s'] * 1e3:.1f} ms at {bandwidth / 1e9:.0f} GB/s",
        f"capacity: {cap}; expected dropped assignments with a random router: {r['dropped']:.2%}"])


CONTROLS = [sel("n_expert", "experts", [4, 8, 16, 32, 64, 128, 256], 8),
            rng("k", "top-k", 1, 8, 1, 2),
            rng("factor", "capacity", 0.25, 3.0, 0.25, 1.25),
            sel("ep", "ep", [1, 2, 4, 8, 16, 32, 64], 8),
            sel("tokens_per_gpu", "tokens/GPU", [1024, 4096, 8192, 16384], 8192),
            sel("bandwidth", "link", [("NVLink 450 GB/s", 450e9), ("InfiniBand 50 GB/s", 50e9),
                                      ("Ethernet 12.5 GB/s", 12.5e9)], 50e9)]


def calculator(**start):
    """Sliders over the calculator's inputs; bad combinations print the error that says why.
    Returned, not displayed: as a cell's last line it shows once."""
    import ipywidgets as widgets

    w = build(CONTROLS)
    for key, v in start.items():
        if key in w:
            w[key].value = v
    out = widgets.Output()

    def redraw():
        with out:
            out.clear_output(wait=True)
            try:
                print(summary(**values(w)))
            except ValueError as err:
                print(f"cannot run: {err}")

    on_change(w, redraw)
    redraw()
    return widgets.VBox(list(w.values()) + [out])


def load_figure(runs: dict, title: str = "tokens per expert (max / mean) over training"):
    """runs: {mode: list of per-step loads}; one line per mode of max/mean load."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for mode, loads in runs.items():
        fig.add_scatter(y=[max(lo) / (sum(lo) / len(lo)) for lo in loads], mode="lines+markers",
                        name=mode)
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="perfectly even")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="busiest expert / mean",
                      height=360, width=680)
    return fig


def heatmap(loads, title: str):
    """Tokens per expert (columns) at every step (rows)."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Heatmap(z=loads, colorscale="Blues", colorbar=dict(title="tokens")))
    fig.update_layout(title=title, xaxis_title="expert", yaxis_title="step", height=320, width=480)
    return fig


def drops_figure(factors, measured, estimate):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_scatter(x=list(factors), y=list(measured), mode="markers",
                    name="measured (random router)")
    fig.add_scatter(x=list(factors), y=list(estimate), mode="lines",
                    name="labkit.costs.moe estimate")
    fig.update_layout(title="capacity factor vs dropped assignments", xaxis_title="capacity factor",
                      yaxis_title="share dropped", height=340, width=620)
    return fig


def routing_picture(n_tokens: int = 6, n_expert: int = 4, ep: int = 2, seed: int = 1):
    """Tokens on two ranks, each routed to k=2 experts; experts coloured by the rank that owns
    them: the lines that cross ranks are what the all-to-all carries."""
    import random

    import plotly.graph_objects as go

    rnd = random.Random(seed)
    fig = go.Figure()
    per = n_expert // ep
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]
    for t in range(n_tokens):
        owner = t * ep // n_tokens
        for e in rnd.sample(range(n_expert), 2):
            cross = e // per != owner
            fig.add_scatter(x=[0, 1], y=[t, e * (n_tokens - 1) / (n_expert - 1)], mode="lines",
                            line=dict(color="red" if cross else "gray", width=2 if cross else 1,
                                      dash="solid" if cross else "dot"), showlegend=False)
    fig.add_scatter(x=[0] * n_tokens, y=list(range(n_tokens)), mode="markers+text",
                    text=[f"token {t} (rank {t * ep // n_tokens})" for t in range(n_tokens)],
                    textposition="middle left", marker=dict(size=12, color=[
                        colors[t * ep // n_tokens] for t in range(n_tokens)]), showlegend=False)
    fig.add_scatter(x=[1] * n_expert,
                    y=[e * (n_tokens - 1) / (n_expert - 1) for e in range(n_expert)],
                    mode="markers+text",
                    text=[f"expert {e} (rank {e // per})" for e in range(n_expert)],
                    textposition="middle right", marker=dict(size=16, symbol="square", color=[
                        colors[e // per] for e in range(n_expert)]), showlegend=False)
    fig.update_layout(title="top-2 routing over ep=2: red lines cross ranks (the all-to-all)",
                      xaxis=dict(visible=False, range=[-0.8, 1.8]), yaxis=dict(visible=False),
                      height=340, width=680)
    return fig
