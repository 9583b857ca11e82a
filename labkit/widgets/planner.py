"""The 3D planner as pictures and a widget: where ranks sit, and what each configuration costs.

    from labkit.widgets import planner as pw
    pw.mesh_figure(Topology(16, dp=2, tp=4, pp=2, gpus_per_node=8))   # rank grid on nodes
    pw.ranked_figure(costs.planner.plan(job, cluster)[:10], cluster)  # time + memory per config
    pw.stability_figure(costs.planner.stability(job, cluster, inter_bw=[...], overlap=[...]))
    pw.planner()                                                       # the interactive planner

All numbers come from labkit.costs.planner (which uses costs.memory, .pipeline, .comm, .flops).
"""
from __future__ import annotations

from labkit.costs import comm, memory, models
from labkit.costs import planner as P
from labkit.widgets.controls import build, check, logrng, rng, sel

GB = 1e9
TIME_PARTS = (("compute", "useful compute"), ("tp", "TP all-reduces"),
              ("bubble", "pipeline bubble"),
              ("pp", "PP sends"), ("dp", "DP traffic not hidden"),
              ("offload", "offload: PCIe + CPU Adam"), ("cp", "CP ring not hidden"),
              ("ep", "EP all-to-alls"))


def time_parts(e: P.Estimate) -> dict:
    return {"compute": e.K * e.compute_s, "tp": e.tp_comm_s, "bubble": e.bubble_s,
            "pp": e.pp_comm_s, "dp": e.dp_exposed_s, "offload": e.offload_s,
            "cp": e.cp_exposed_s, "ep": e.ep_comm_s}


def ranked_figure(estimates, cluster: P.Cluster, title: str = ""):
    """Left: the step time of each configuration split into its parts. Right: memory per GPU."""
    from plotly.subplots import make_subplots

    # "TP8 x PP4 x DP8<br>ZeRO-2, b=1": a plan's name on two lines, so that at 390 px (a phone)
    # the bars keep the width
    labels = [str(e.config).replace(", ", "<br>", 1) for e in estimates][::-1]
    ests = list(estimates)[::-1]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, column_widths=[0.6, 0.4],
                        subplot_titles=("seconds per step", "GB per GPU"))
    for key, name in TIME_PARTS:
        fig.add_bar(y=labels, x=[time_parts(e)[key] for e in ests], name=name, orientation="h",
                    row=1, col=1)
    for comp in memory.MemoryPlan.COMPONENTS:
        fig.add_bar(y=labels, x=[getattr(e.memory, comp) / GB for e in ests], orientation="h",
                    name=memory.MemoryPlan.LABELS[comp], row=1, col=2)
    fig.add_vline(x=cluster.usable / GB, line_dash="dot", row=1, col=2)   # capacity less margin
    fig.update_layout(barmode="stack", height=140 + 36 * len(labels), title=title,
                      legend_orientation="h", legend_y=-0.15, margin_l=10, margin_r=10)
    return fig


def stability_figure(result, title: str = ""):
    """One panel per swept input: each top plan's time per step (failures included) against the
    input's value. Lines that cross are a ranking that does not hold."""
    from plotly.subplots import make_subplots

    names = list(result["sweeps"])
    axis = {"inter_bw": ("inter-node GB/s per GPU", 1e-9), "overlap": ("overlap efficiency", 1),
            "intra_bw": ("intra-node GB/s per GPU", 1e-9)}
    fig = make_subplots(rows=1, cols=len(names), shared_yaxes=True,
                        subplot_titles=[axis.get(n, (n, 1))[0] for n in names])
    palette = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#9D755D"]
    for col, name in enumerate(names, 1):
        sw, scale = result["sweeps"][name], axis.get(name, (name, 1))[1]
        xs = [v * scale for v in sw["values"]]
        for i, c in enumerate(result["plans"]):
            fig.add_scatter(x=xs, y=sw["step_s"][c], mode="lines+markers", name=str(c),
                            legendgroup=str(c), showlegend=col == 1, row=1, col=col,
                            line_color=palette[i % len(palette)])
    fig.update_yaxes(title_text="seconds per step (failures included)", row=1, col=1)
    fig.update_layout(height=380, title=title or "Does the ranking hold when an input changes?",
                      legend_orientation="h", legend_y=-0.2)
    return fig


def mesh_figure(topo):
    """One cell per GPU, one row per node: colour = pipeline stage, text = rank and (dp, tp)."""
    import plotly.graph_objects as go

    per_node = topo.gpus_per_node or topo.world
    nodes = -(-topo.world // per_node)
    z, text = [], []
    for node in range(nodes):
        zr, tr = [], []
        for gpu in range(per_node):
            r = node * per_node + gpu
            if r >= topo.world:
                zr.append(None), tr.append("")
                continue
            c = topo.coords(r)
            zr.append(c["pp"])
            tr.append(f"r{r}<br>dp{c['dp']} tp{c['tp']}")
        z.append(zr), text.append(tr)
    fig = go.Figure(go.Heatmap(z=z, text=text, texttemplate="%{text}", colorscale="Viridis",
                               showscale=topo.pp > 1, colorbar_title="PP stage", xgap=3, ygap=3,
                               hoverinfo="skip"))
    fig.update_layout(height=90 + 60 * nodes, title=f"PP {topo.pp} x DP {topo.dp} x TP {topo.tp} "
                      f"on {nodes} node(s) of {per_node} GPUs (TP groups are consecutive ranks)",
                      xaxis_title="GPU in node", yaxis_title="node", yaxis_autorange="reversed")
    return fig


LINKS = {name: link.bandwidth for name, link in comm.LINKS.items()}
COLUMNS = ["TP", "PP", "DP", "CP", "EP", "ZeRO", "offload", "micro-batch", "K", "memory GB",
           "headroom GB", "bubble %", "DP exposed s", "step s", "MFU %", "HFU %", "eff. step s"]


def rank(model, n_gpus, gpus_per_node, gpu, intra, inter, global_batch, seq_len, recipe,
         recompute, sequence_parallel, overlap, margin, efficiency, mtbf_h,
         grad_reduce="fp32", overlap_param_gather=False):
    """(ranked estimates, job, cluster) for the planner's inputs (links by name). grad_reduce:
    the gradients' reduction dtype ("fp32", the default of Megatron, torchtitan and Llama 3, or
    "bf16"); overlap_param_gather: ZeRO-1/2's parameter all-gather under the next forward."""
    cluster = P.Cluster(n_gpus, gpus_per_node, gpu, intra_bw=LINKS[intra], inter_bw=LINKS[inter],
                        overlap=overlap, memory_margin=margin, flop_efficiency=efficiency,
                        gpu_mtbf_h=mtbf_h)
    job = P.Job(model, global_batch=global_batch, seq_len=seq_len, recipe=recipe,
                recompute=recompute, sequence_parallel=sequence_parallel,
                grad_reduce=grad_reduce, overlap_param_gather=overlap_param_gather)
    return P.plan(job, cluster), job, cluster


def summary(ranked, job, cluster, top: int) -> str:
    """The planner's text: the top configurations and why the first one wins."""
    if not ranked:
        return "No configuration fits: more GPUs, a bigger GPU, recomputation, or ZeRO-3."
    return "\n".join([P.table(ranked[:top], COLUMNS), "", "why the first one:"]
                     + [f" - {line}" for line in P.reasons(ranked[0], job, cluster)])


CONTROLS = [
    sel("model", "model", list(models.PRESETS), "llama2-70b"),
    sel("n_gpus", "GPUs", [8, 16, 32, 64, 128, 256, 512, 1024], 128),
    sel("gpus_per_node", "GPUs per node", [4, 8], 8),
    sel("gpu", "GPU", list(memory.GPUS), "A100 80GB"),
    sel("intra", "intra-node link", list(LINKS), "NVLink 3 (A100 SXM)"),
    sel("inter", "inter-node link", list(LINKS), "InfiniBand HDR 200 Gb/s"),
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
    rng("top", "rows shown", 3, 20, 1, 8)]


def planner():
    """Model, cluster and batch -> the top configurations, their costs and the best one's
    reasons."""
    import ipywidgets as w
    from IPython.display import display

    def show(model, n_gpus, gpus_per_node, gpu, intra, inter, global_batch, seq_len, recipe,
             recompute, sequence_parallel, grad_reduce, overlap_param_gather, overlap, margin,
             efficiency, mtbf_h, top):
        ranked, job, cluster = rank(model, n_gpus, gpus_per_node, gpu, intra, inter, global_batch,
                                    seq_len, recipe, recompute, sequence_parallel, overlap, margin,
                                    efficiency, mtbf_h, grad_reduce, overlap_param_gather)
        print(summary(ranked, job, cluster, top))
        if not ranked:
            return
        display(ranked_figure(ranked[:top], cluster,
                              f"{models.preset(model).name} on {n_gpus} x {gpu}"))

    return w.interactive(show, **build(CONTROLS))
