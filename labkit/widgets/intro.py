"""Chapter 00's calculator: the bytes a model needs before it sees a single token.

    from labkit.widgets import intro
    intro.memory_figure("llama2-7b", "mixed")     # stacked bar vs GPU sizes (plotly)
    intro.calculator()                            # dropdowns: model, recipe, ZeRO stage, GPUs

Every number comes from labkit.costs.models (parameter counts) and labkit.costs.memory
(precision recipes, ZeRO stages), so the widget and the text can never disagree.
"""
from __future__ import annotations

import math

from labkit.costs import memory, models
from labkit.widgets.controls import build, rng, sel

GB = 1e9
PARTS = (("params", "weights"), ("grads", "gradients"), ("optimizer", "optimizer states"))


def state_rows(model, recipe: str, zero: int = 0, dp: int = 1) -> dict:
    """{'weights', 'gradients', 'optimizer states', 'total'} in GB (1e9 bytes) per GPU."""
    spec = model if isinstance(model, models.ModelSpec) else models.preset(model)
    s = memory.model_states(models.num_params(spec), recipe=recipe, zero=zero, dp=dp)
    out = {label: getattr(s, attr) / GB for attr, label in PARTS}
    out["total"] = s.total / GB
    return out


def memory_figure(models_=("gpt2-124m", "llama2-7b", "llama2-13b", "llama2-70b", "gpt3-175b"),
                  recipe: str = "mixed", zero: int = 0, dp: int = 1, log: bool = True):
    """Stacked bars of model-state GB per GPU for several presets, with GPU capacities drawn."""
    import plotly.graph_objects as go

    if isinstance(models_, str):
        models_ = (models_,)
    names = [models.preset(m).name for m in models_]
    rows = [state_rows(m, recipe, zero, dp) for m in models_]
    fig = go.Figure()
    for _, label in PARTS:
        fig.add_bar(name=label, x=names, y=[r[label] for r in rows])
    for gpu in ("A100 40GB", "H100 80GB", "H200 141GB"):
        y = memory.GPUS[gpu] / GB
        fig.add_hline(y=y, line_dash="dot")
        # On a log axis plotly places annotations at log10(y) but lines at y: label by hand.
        fig.add_annotation(y=math.log10(y) if log else y, x=1, xref="paper", xanchor="right",
                           yanchor="bottom", text=f"{gpu} ({y:.0f} GB)", showarrow=False)
    where = f"ZeRO-{zero} over {dp} GPUs" if zero else "one GPU"
    fig.update_layout(barmode="stack", height=380, yaxis_type="log" if log else "linear",
                      title=f"Model states per GPU, recipe '{recipe}' "
                            f"({memory.get_recipe(recipe).total:g} bytes/param), {where}",
                      yaxis_title="GB (1e9 bytes)", legend_orientation="h")
    return fig


def triangle_figure():
    """The memory / compute / communication triangle and what each technique trades."""
    import plotly.graph_objects as go

    corners = {"memory": (0.0, 0.0), "compute": (1.0, 0.0), "communication": (0.5, 0.87)}
    xs = [p[0] for p in corners.values()] + [0.0]
    ys = [p[1] for p in corners.values()] + [0.0]
    fig = go.Figure(go.Scatter(x=xs, y=ys, mode="lines+markers+text", showlegend=False,
                               text=list(corners) + [""], textposition=["bottom left",
                               "bottom right", "top center", "bottom left"]))
    trades = [((0.5, -0.08), "recomputation: compute for memory"),
              ((0.12, 0.5), "ZeRO / TP / PP: communication for memory"),
              ((0.88, 0.5), "DP: communication for compute (more GPUs)")]
    for (x, y), text in trades:
        fig.add_annotation(x=x, y=y, text=text, showarrow=False)
    fig.update_layout(height=330, xaxis_visible=False, yaxis_visible=False,
                      title="Every technique in this book moves cost along one edge",
                      xaxis_range=[-0.4, 1.4], yaxis_range=[-0.2, 1.0])
    return fig


def summary(model, recipe: str, zero: int = 0, dp: int = 1) -> str:
    """The calculator's line of text (the website's calculator prints the same)."""
    rows = state_rows(model, recipe, zero, dp)
    return (" + ".join(f"{k} {v:.1f}" for k, v in rows.items() if k != "total")
            + f" = {rows['total']:.1f} GB per GPU")


CONTROLS = [sel("model", "model", list(models.PRESETS), "llama2-7b"),
            sel("recipe", "recipe", list(memory.RECIPES), "mixed"),
            rng("zero", "ZeRO stage", 0, 3, 1, 0),
            rng("dp", "GPUs (dp)", 1, 64, 1, 8)]   # the website's calculator: the same list


def calculator():
    """Dropdowns and sliders over memory_figure: model, recipe, ZeRO stage, number of GPUs."""
    import ipywidgets as w
    from IPython.display import display

    def show(model, recipe, zero, dp):
        display(memory_figure((model,), recipe, zero if dp > 1 else 0, dp, log=False))
        print(summary(model, recipe, zero, dp))

    return w.interactive(show, **build(CONTROLS))
