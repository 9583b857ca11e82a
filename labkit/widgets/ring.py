"""The ring all-reduce, step by step: which partial sums each rank's chunks hold.

    from labkit.widgets.ring import ring_explorer, ring_figure
    ring_explorer(4)          # a slider over the 2(N-1) steps
    ring_figure(4, step=3)    # one frame, as a plotly figure
    frames()                  # every frame for N = 2..8 as plotly JSON (the website's explorer)

The frames are computed from labkit.collectives.ring_schedule, the same plan the real ring
follows, so the picture cannot drift from the code.
"""
from __future__ import annotations

from labkit.collectives import ring_schedule


def ring_states(n: int) -> list:
    """Frames 0..2(n-1): frame[k][rank][chunk] = sorted tuple of ranks whose data that copy sums."""
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    frames = [[[tuple(sorted(c)) for c in row] for row in holds]]
    for phase in ("reduce_scatter", "all_gather"):
        for plan in ring_schedule(n, phase):
            sent = [holds[r][plan[r][0]] for r in range(n)]  # what each rank sends this step
            for r in range(n):
                left = (r - 1) % n
                chunk = plan[r][1]
                holds[r][chunk] = (holds[r][chunk] | sent[left]) if phase == "reduce_scatter" \
                    else sent[left]
            frames.append([[tuple(sorted(c)) for c in row] for row in holds])
    return frames


def step_label(n: int, step: int) -> str:
    if step == 0:
        return "start: every rank holds only its own data"
    if step <= n - 1:
        return f"reduce-scatter, step {step} of {n - 1}"
    return f"all-gather, step {step - (n - 1)} of {n - 1}"


def ring_figure(n: int = 4, step: int = 0):
    """Heatmap: rows are ranks, columns chunks; colour = how many ranks' data the copy sums."""
    import plotly.graph_objects as go

    frames = ring_states(n)
    if not 0 <= step < len(frames):
        raise ValueError(f"step must be in 0..{len(frames) - 1} for {n} ranks, got {step}")
    frame = frames[step]
    z = [[len(c) for c in row] for row in frame]
    text = [["+".join(map(str, c)) for c in row] for row in frame]
    fig = go.Figure(go.Heatmap(
        z=z, text=text, texttemplate="%{text}", zmin=1, zmax=n, colorscale="Blues",
        x=[f"chunk {c}" for c in range(n)], y=[f"rank {r}" for r in range(n)],
        # the colour bar under the heatmap, not beside it: at 390 px (a phone) the plot keeps
        # the width
        colorbar=dict(title=dict(text="ranks summed", side="top"), orientation="h", y=-0.12,
                      yanchor="top", thickness=12, len=0.6),
        hovertemplate="%{y}, %{x}: sum of ranks %{text}"))
    if step > 0:  # arrows: which chunk each rank sent to reach this frame
        phase = "reduce_scatter" if step <= n - 1 else "all_gather"
        plan = ring_schedule(n, phase)[(step - 1) % (n - 1)]
        for r in range(n):
            fig.add_annotation(x=f"chunk {plan[r][0]}", y=f"rank {(r + 1) % n}",
                               ax=f"chunk {plan[r][0]}", ay=f"rank {r}", xref="x", yref="y",
                               axref="x", ayref="y", showarrow=True, arrowhead=2, opacity=0.5)
    fig.update_layout(title=f"Ring all-reduce, {n} ranks — {step_label(n, step)}",
                      yaxis=dict(autorange="reversed"), height=380 + 20 * n, width=620,
                      margin=dict(l=60, r=20, t=60, b=40))
    return fig


def frames(ns=range(2, 9)) -> dict:
    """{N: [frame 0 .. 2(N-1) as plotly JSON dicts]}: the explorer's frames, drawn ahead of time
    for the website, where its sliders switch between them (no Python in the browser)."""
    import plotly.io as pio

    return {n: [pio.to_json(ring_figure(n, k), validate=False) for k in range(2 * (n - 1) + 1)]
            for n in ns}


def ring_explorer(n: int = 4):
    """A slider over the steps (and one over N): the ring, frame by frame. Returned, not
    displayed: as a cell's last line it shows once (displaying it too saved it twice)."""
    import ipywidgets as widgets

    ranks = widgets.IntSlider(value=n, min=2, max=8, description="ranks N")
    step = widgets.IntSlider(value=0, min=0, max=2 * (n - 1), description="step")
    out = widgets.Output()

    def redraw(*_):
        step.max = 2 * (ranks.value - 1)
        with out:
            out.clear_output(wait=True)
            ring_figure(ranks.value, min(step.value, step.max)).show()

    ranks.observe(redraw, "value")
    step.observe(redraw, "value")
    redraw()
    return widgets.VBox([widgets.HBox([ranks, step]), out])
