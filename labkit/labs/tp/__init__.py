"""Lab 04: the tiny GPT, tensor-parallel over N ranks, against the one-process GPT.

    labkit run tp --nproc 2 [--steps 2 --batch 4 --n-layer 2]
    torchrun --nproc-per-node 2 -m labkit run tp                 # one rank per process

Every rank builds the same GPT (seed 0) and keeps its shards (labkit.tp.apply_tp) on its device
(its GPU under NCCL); the one-process reference runs on the CPU. Rank 0 prints,
per SGD step, the loss of both models and the largest gradient difference, then every
collective of one step as the comm log saw it (op, shape, bytes vs the formula b*s*h elements),
and the bytes each rank's sockets sent in that step, counted by the kernel (observe.netcount),
next to labkit.costs.tensor_parallel's n_layer * 4 * 2(N-1)/N * b*s*h*4.

The experiments beside the lab (labkit.tp holds the algorithm):
    measure            rank jobs that log every TP collective, count the bytes the kernel saw and
                       time a layer as TP grows (this lab, `labkit bench tp`, chapter 04)
    crossover          one rank's layer matmuls timed per width (labkit run overlap_tp)
    collective_matmul  the collective matmul timed against gather-then-multiply (chapter 04)
"""

from labkit.cliargs import add_gpt_size, count, lab_parser
from labkit.costs import tensor_parallel as tpc
from labkit.labs import ran_on
from labkit.labs.tp.measure import train_side_by_side
from labkit.launch import run
from labkit.model import GPTConfig
from labkit.observe.measured import Measured, measured_table
from labkit.progress import Progress, is_rank_zero
from labkit.tp.gpt import check_tp_sizes

BACKEND = "auto"  # tensors on labkit.launch.device(): NCCL where there is a GPU per rank


def main(argv=()):

    p = lab_parser("tp", nproc=2, nproc_help="the tensor-parallel degree (processes; under "
                                             "torchrun: its world size)")
    p.add_argument("--steps", type=count, default=2, help="SGD steps")
    p.add_argument("--batch", type=count, default=4, help="sequences per step")
    add_gpt_size(p, n_layer=2, n_embd=32, embd_help="hidden size (a multiple of --n-head)")
    p.add_argument("--n-head", type=count, default=4, help="attention heads (--nproc divides it)")
    p.add_argument("--block-size", type=count, default=32, help="tokens per sequence")
    a = p.parse_args(list(argv))
    cfg = dict(n_layer=a.n_layer, n_embd=a.n_embd, n_head=a.n_head, block_size=a.block_size)
    if a.n_embd % a.n_head:
        raise ValueError(f"--n-embd {a.n_embd} must be a multiple of --n-head {a.n_head}; use "
                         f"--n-embd {a.n_embd // a.n_head * a.n_head or a.n_head}")
    model_cfg = GPTConfig(**cfg)
    try:                                          # before any process starts: one clear line
        check_tp_sizes(model_cfg, a.nproc)
    except ValueError as err:
        fit = [d for d in range(1, a.n_head + 1) if _divides(model_cfg, d)]
        raise ValueError(f"--nproc {a.nproc}, the TP degree: {err} Use --nproc "
                         f"{' or '.join(map(str, fit))}, or another --n-head") from None
    prog = Progress("tp", total=1)
    prog.say(f"TP={a.nproc}: the tensor-parallel GPT and the one-process GPT, {a.steps} SGD "
             f"steps side by side")
    per_rank = run(train_side_by_side, a.nproc, args=(cfg, a.steps, a.batch))
    res = per_rank[0]
    worst = max(d for _, _, _, d in res["rows"])
    prog.done(f"trained {a.steps} steps; max |grad diff| {worst:.1e}; "
              f"{len(res['events'])} all-reduces recorded")
    if is_rank_zero():  # under torchrun, every rank ran main; one reports
        _report(a, per_rank)
    return 0


def _report(a, per_rank) -> None:
    """Rank 0's report: loss and gradient difference per step, the collectives of one step
    against the formula, and the bytes the kernel counted against labkit.costs."""

    res = per_rank[0]
    print(f"TP={a.nproc}: GPT n_layer={a.n_layer} n_embd={a.n_embd} n_head={a.n_head}, "
          f"batch {a.batch} x {a.block_size} tokens, fp32; {ran_on(res['backend'], res['device'])}")
    print(f"{'step':>4} {'loss (1 process)':>17} {'loss (TP)':>10} {'max |grad diff|':>16}")
    for step, lr, lt, d in res["rows"]:
        print(f"{step:>4} {lr:>17.6f} {lt:>10.6f} {d:>16.2e}")
    pred = tpc.allreduce_bytes(a.batch, a.block_size, a.n_embd, 4)
    print(f"\ncollectives in one step (rank 0); formula b*s*h*4 bytes = {pred}")
    print(f"{'pass':>8} {'op':>10} {'where':>12} {'shape':>14} {'bytes':>8} {'= formula':>9}")
    for e in res["events"]:
        print(f"{e['phase']:>8} {e['op']:>10} {e['where']:>12} {str(e['shape']):>14} "
              f"{e['bytes']:>8} {str(e['bytes'] == pred):>9}")
    per_layer = len(res["events"]) / a.n_layer
    formula = tpc.allreduces_per_layer('both') if a.nproc > 1 else 0
    print(f"{len(res['events'])} all-reduces for {a.n_layer} layers = {per_layer:g} per layer "
          f"(formula: {formula}" + (", TP=1 has no shards to sum)" if a.nproc == 1 else ")"))
    wire = a.n_layer * tpc.layer_bytes_sent_per_rank(a.batch, a.block_size, a.n_embd, a.nproc, 4)
    sent = [r["sent"] for r in per_rank]
    if None in sent:
        print(f"bytes sent: not counted ({res['wire_reason']})")
        return
    rows = [Measured(f"rank {r}", b, wire, "kernel TCP", "bytes") for r, b in enumerate(sent)]
    print(measured_table(rows, title="bytes each rank sent in that step, counted by the kernel, "
                                     "against labkit.costs (ring)"))
    if wire == 0:
        print("ratio n.a. (one rank sends nothing: run --nproc 2 or more to count TP's bytes)")
    else:
        steps = len(res["events"]) * 2 * (a.nproc - 1)        # ring steps of the all-reduces
        print(f"the excess, {(max(sent) - wire) / steps:.0f} bytes per ring step, is Gloo's "
              f"message headers (a fixed cost per message: it does not grow with b*s*h)")


def _divides(cfg, tp: int) -> bool:
    """Whether TP degree `tp` splits the model's heads and MLP evenly."""

    try:
        check_tp_sizes(cfg, tp)
    except ValueError:
        return False
    return True
