"""Benchmark: step time and bytes per rank of ZeRO stages 0-3, against PyTorch's DDP and FSDP2.

    labkit bench zero [--ranks 4] [--runs 3] [--steps 6] [--n-embd 64] [--n-layer 4] [--foreach]
                      [--zero3-units fsdp2|modules]

All variants train the same GPT (the same AdamW, labkit.reference.OPTIMIZERS["adamw"], torch's
default single-tensor update on a CPU; fp32 unless the row says bf16) on the same ranks in the same
run, after the same warm-up steps, one step of each in turn (interleaved, so drifting load hits all
alike; each step starts at the next variant, so none always follows the same one); the step time is
the median over steps of the slowest rank, reported with its ratio to torch DDP and to FSDP2 (the
bf16 rows: to FSDP2 with the same MixedPrecisionPolicy). ZeRO-3 and FSDP2 cut the model into the
same units (labkit.zero.unit.fsdp2_units: fully_shard on each block, then on the model, whose root
group holds the embeddings, final norm and head and stays whole from forward to backward in both;
--zero3-units modules gives ZeRO-3 its default_units instead). Prefetch: FSDP2 runs with its
defaults (implicit backward prefetch, no explicit forward prefetch; unshard_async_op False, so on a
CPU its all-gathers are synchronous: torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
unshard); "ZeRO-3" prefetches nothing, "ZeRO-3 prefetch" posts the next unit's all-gather,
asynchronously, in forward and in backward. "of it step()" is the part spent in the stage's step()
call (same median): the optimizer, and for ZeRO-0/1/2 the communication their step does. On a CPU
torch's AdamW updates one tensor at a time, and each op on FSDP2's DTensor parameters pays
DTensor's dispatch; --foreach gives every variant foreach=True (torch's default on GPUs, DTensors
included: torch/optim/optimizer.py, _default_to_fused_or_foreach), which takes most of that away,
so what is left of the comparison is forward and backward.
ZeRO-3 runs without and with prefetch (labkit.zero.prefetch), with a bf16 policy, and with the
optimizer offloaded to the CPU
(ZeRO-2 too: ZeRO-Offload's own stage); ZeRO-1 with the bf16 policy is the ZeRO paper's 16-byte
mixed precision. ZeRO-2 runs with its 64 KB buckets and with one bucket (what its buckets' latency
costs where, as on a CPU, backward leaves nothing to overlap them with). Bytes are what each rank
keeps after a step, by storage (views once), on the device and (offload) in CPU memory, next to
labkit.costs.memory's prediction for the recipe the variant runs (RECIPE). On CPU/Gloo the ratios
show the cost of our collectives on Gloo, not what NCCL would do on GPUs.

A single run's ratio moves by as much as the gaps it measures (two quiet runs once gave ZeRO-3
0.98-1.17x FSDP2's step), so the benchmark launches --runs separate interleaved runs and prints
each ratio as its median with the range over the runs, and says in how many runs ZeRO-3 with
prefetch stepped at or under FSDP2.
"""
from __future__ import annotations

import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from labkit.cliargs import add_gpt_size, at_least_zero, bench_parser, count
from labkit.costs import memory, models
from labkit.labs.zero.train import make_stage
from labkit.launch import run
from labkit.model import GPT, GPTConfig, get_batch, shard_rows, tiny_corpus
from labkit.observe.measured import Measured
from labkit.observe.storage import storage_bytes
from labkit.reference import optimizer_spec
from labkit.table import table as format_table
from labkit.zero.precision import MixedPrecisionPolicy as Policy
from labkit.zero.shard import optimizer_state_bytes
from labkit.zero.unit import fsdp2_units

VARIANTS = ("torch DDP", "ZeRO-0", "ZeRO-1", "ZeRO-2", "ZeRO-2 1 bucket", "ZeRO-2 offload",
            "ZeRO-3", "ZeRO-3 prefetch", "ZeRO-3 offload", "torch FSDP2", "ZeRO-1 bf16",
            "ZeRO-3 bf16", "torch FSDP2 bf16")
# keyword arguments of the labkit variants beyond their stage's defaults
STAGE_KW = {"ZeRO-3 prefetch": dict(prefetch=True), "ZeRO-1 bf16": dict(bf16=True),
            "ZeRO-3 offload": dict(prefetch=True, offload=True),
            "ZeRO-2 offload": dict(offload=True),
            # all gradients in one reduce-scatter: how much of ZeRO-2's time is its buckets'
            # per-message latency (64 KB each by default), with no backward to overlap on a CPU
            "ZeRO-2 1 bucket": dict(bucket_bytes=1 << 40),
            "ZeRO-3 bf16": dict(prefetch=True, bf16=True)}
# (stage, bytes/param of weights, gradients, optimizer state, offload) as the variant keeps them:
# fp32 shards, gradients and Adam's m and v; bf16 compute keeps fp32 shards too (FSDP2's way);
# ZeRO-3 offload keeps a device copy of the shard, and the fp32 master beside m and v on the CPU
# (ZeRO-2 offload: the full parameters on the device, the gradient shard and master + m + v on
# the CPU);
# ZeRO-1 bf16 is the ZeRO paper's mixed precision: bf16 model and gradients, fp32 master + m + v
RECIPE = {"torch DDP": (0, 4, 4, 8, False), "torch FSDP2": (3, 4, 4, 8, False),
          "torch FSDP2 bf16": (3, 4, 4, 8, False), "ZeRO-3 offload": (3, 4, 4, 12, True),
          "ZeRO-2 offload": (2, 4, 4, 12, True),
          "ZeRO-1 bf16": (1, 2, 2, 12, False),
          **{n: (3, 4, 4, 8, False) for n in ("ZeRO-3 prefetch", "ZeRO-3 bf16")},
          "ZeRO-2 1 bucket": (2, 4, 4, 8, False),
          **{f"ZeRO-{s}": (s, 4, 4, 8, False) for s in range(4)}}
adamw, ADAMW = optimizer_spec("adamw")      # the torch rows' optimizer: the ZeRO rows' own
PEER = {"ZeRO-3 bf16": "torch FSDP2 bf16", "torch FSDP2 bf16": "torch FSDP2 bf16",
        "ZeRO-1 bf16": "torch FSDP2 bf16"}


def _on_rank(cfg, steps, warmup, batch_size, foreach=None, zero3_units="fsdp2"):



    rank, world = dist.get_rank(), dist.get_world_size()
    variants = {}
    for name in VARIANTS:
        model = GPT(cfg, seed=0)
        if name == "torch DDP":
            wrapped = DDP(model)
            opt = adamw(model.parameters(), **ADAMW, foreach=foreach)
            variants[name] = (wrapped, opt.step, lambda o=opt: o.zero_grad(), opt, model)
        elif name.startswith("torch FSDP2"):
            mesh = init_device_mesh("cpu", (world,))
            kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.float32)) \
                if name.endswith("bf16") else {}
            for unit in reversed(fsdp2_units(model)):       # the blocks, then the root
                fully_shard(unit, mesh=mesh, **kw)
            opt = adamw(model.parameters(), **ADAMW, foreach=foreach)
            variants[name] = (model, opt.step, lambda o=opt: o.zero_grad(), opt, model)
        else:
            kw = dict(STAGE_KW.get(name, {}))
            if RECIPE[name][0] == 3 and zero3_units == "fsdp2":
                kw["units"] = fsdp2_units          # FSDP2's units, as fully_shard wraps above
            if kw.pop("bf16", False):
                kw["mp_policy"] = Policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            zero = make_stage(RECIPE[name][0], model, "adamw", foreach=foreach, **kw)
            variants[name] = (model, zero.step, zero.zero_grad, zero, model)
    tokens = tiny_corpus()
    times, step_call_times = {n: [] for n in VARIANTS}, {n: [] for n in VARIANTS}
    held = {}
    for step in range(warmup + steps):
        x, y = get_batch(tokens, batch_size, cfg.block_size, step)
        x, y = shard_rows(x, rank, world), shard_rows(y, rank, world)
        names = VARIANTS[step % len(VARIANTS):] + VARIANTS[:step % len(VARIANTS)]
        for name in names:
            fwd, step_fn, zero_grad, holder, model = variants[name]
            dist.barrier()
            t0 = time.perf_counter()
            fwd(x, y)[1].backward()
            t1 = time.perf_counter()
            step_fn()
            dt = time.perf_counter() - t0
            if step >= warmup:
                times[name].append(dt)
                step_call_times[name].append(time.perf_counter() - t1)
            if step == warmup + steps - 1:
                held[name] = _held(name, holder, model, optimizer_state_bytes)
            zero_grad()
    return {"times": times, "step_call_times": step_call_times, "held": held}


def _held(name, holder, model, optimizer_state_bytes):
    """Bytes kept, by storage (labkit.zero.shard.storage_bytes): the ZeRO stages say which
    tensors are what; torch's: parameters, .grad and optimizer state (DTensors' local shards)."""

    if name.startswith("ZeRO"):
        return holder.held_bytes()

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    return {"params": storage_bytes(local(p) for p in model.parameters()),
            "grads": storage_bytes(local(p.grad) for p in model.parameters()),
            "optimizer": storage_bytes(local(v) for s in holder.state.values()
                                       for v in s.values() if v.dim() > 0)}


def measure(nprocs, cfg, steps=6, warmup=2, batch_size=None, timeout=600,
            foreach=None, zero3_units="fsdp2") -> list:

    batch_size = batch_size or 2 * nprocs
    per_rank = run(_on_rank, nprocs,
                   args=(cfg, steps, warmup, batch_size, foreach, zero3_units),
                   timeout=timeout, echo=False)
    numel = sum(v for v in [_numel(cfg)])
    med, opt = ({n: statistics.median(max(r[key][n][i] for r in per_rank) for i in range(steps))
                 for n in VARIANTS} for key in ("times", "step_call_times"))
    rows = []
    for n in VARIANTS:
        stage, w, g, o, off = RECIPE[n]
        ms = memory.model_states(numel, recipe=memory.Precision(n, w, g, o), zero=stage,
                                 dp=nprocs, offload_optimizer=off)
        held = max(sum(v for k, v in r["held"][n].items() if not k.startswith("cpu"))
                   for r in per_rank)
        cpu = max(sum(v for k, v in r["held"][n].items() if k.startswith("cpu"))
                  for r in per_rank)
        peer = PEER.get(n, "torch FSDP2")
        rows.append({"ranks": nprocs, "variant": n, "stage": stage, "step_s": med[n],
                     "step_call_s": opt[n],
                     "ratio_to_torch_ddp": med[n] / med["torch DDP"],
                     "ratio_to_fsdp2": med[n] / med[peer], "fsdp2_peer": peer,
                     "bytes_per_rank": held, "bytes_predicted": ms.total,
                     "cpu_bytes_per_rank": cpu, "cpu_bytes_predicted": ms.cpu_total,
                     "bytes_ratio": Measured("bytes held", held + cpu, ms.total + ms.cpu_total,
                                             counter="storage sizes").ratio, "numel": numel})
    base = {r["variant"]: r["step_s"] for r in rows}
    for r in rows:      # the prefetch's gain, same run
        if r["variant"] == "ZeRO-3 prefetch":
            r["prefetch_speedup"] = base["ZeRO-3"] / r["step_s"]
    return rows


def over_runs(runs: list) -> list:
    """One row per variant from several runs of `measure` (same ranks): the median step and
    ratios, each ratio's per-run values ("<key>_runs") and its range; bytes from the first run
    (they do not depend on timing)."""
    rows = []
    for i, first in enumerate(runs[0]):
        same = [run_rows[i] for run_rows in runs]
        row = dict(first, runs=len(runs))
        for key in ("step_s", "step_call_s", "ratio_to_torch_ddp", "ratio_to_fsdp2",
                    "prefetch_speedup"):
            if key in first:
                values = [r[key] for r in same]
                row[key] = statistics.median(values)
                row[f"{key}_runs"] = values
        rows.append(row)
    return rows


def _numel(cfg):

    return models.num_params(models.from_gpt_config(cfg))


def table(rows) -> str:
    return format_table(rows, [
        ("ranks", "ranks"),
        ("variant", "variant"),
        ("step ms", lambda r: r["step_s"] * 1e3, ".1f"),
        ("of it step()", lambda r: r.get("step_call_s", math.nan) * 1e3, ".1f"),
        ("vs DDP", "ratio_to_torch_ddp", lambda v: f"{v:.2f}x", ">"),
        ("vs FSDP2", "ratio_to_fsdp2", lambda v: f"{v:.2f}x", ">"),
        ("FSDP2 range", lambda r: r.get("ratio_to_fsdp2_runs", [r["ratio_to_fsdp2"]]),
         lambda v: f"{min(v):.2f}-{max(v):.2f}x", ">"),
        ("device KB", lambda r: r["bytes_per_rank"] / 1e3, ".1f"),
        ("predicted", lambda r: r["bytes_predicted"] / 1e3, ".1f"),
        ("CPU KB", lambda r: r["cpu_bytes_per_rank"] / 1e3, ".1f"),
        ("predicted", lambda r: r["cpu_bytes_predicted"] / 1e3, ".1f"),
        ("held/pred", "bytes_ratio", ".4f")])


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("zero", ranks=[4])
    p.add_argument("--runs", type=count, default=3,
                   help="separate interleaved runs; ratios are their median, with the range")
    p.add_argument("--steps", type=count, default=6, help="timed steps")
    p.add_argument("--warmup", type=at_least_zero, default=2, help="untimed steps first")
    p.add_argument("--zero3-units", choices=("fsdp2", "modules"), default="fsdp2",
                   help="the ZeRO-3 rows' units: FSDP2's (each block + the root, as the FSDP2 "
                        "rows wrap) or labkit's default_units (each block, each embedding, the "
                        "final norm and the head apart: more, smaller messages)")
    p.add_argument("--foreach", action="store_true",
                   help="every variant's AdamW with foreach=True (torch's default on GPUs; on a "
                        "CPU torch runs one tensor at a time, which costs FSDP2's DTensors most)")
    add_gpt_size(p, n_layer=4, n_embd=64)
    return p.parse_known_args(list(argv or ()))


def main(argv=()) -> dict:

    args, _ = options(argv)
    cfg = GPTConfig(block_size=32, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                    tie_weights=False)
    rows = []
    for n in args.ranks:
        rows += over_runs([measure(n, cfg, steps=args.steps, warmup=args.warmup,
                                   foreach=args.foreach or None,
                                   zero3_units=args.zero3_units)
                           for _ in range(args.runs)])
    print(f"{args.runs} runs, each interleaving every variant step by step; step ms and ratios: "
          f"the median over runs, FSDP2 range: lowest to highest ratio to FSDP2 over the runs")
    print(f"GPT n_layer={args.n_layer} n_embd={args.n_embd} (Ψ = {_numel(cfg):,}), AdamW; "
          f"bytes = params + grads + optimizer state kept by the largest rank after a step, by "
          f"storage; vs FSDP2: the bf16 rows against FSDP2 with the same policy")
    units = ("ZeRO-3 and FSDP2 on the same units (each block; the root: embeddings, final norm, "
             "head)") if args.zero3_units == "fsdp2" else ("ZeRO-3 on labkit's default units (each "
                                                          "block, embedding, norm, head apart), "
                                                          "FSDP2 on each block + the root")
    print(f"{units}; FSDP2 with its default prefetch (implicit, backward; synchronous on a CPU), "
          f"'ZeRO-3 prefetch' posting the next unit's all-gather in forward and backward")
    print(f"AdamW foreach={bool(args.foreach)} for every variant; ZeRO-3 units: "
          f"{args.zero3_units}", flush=True)
    print(table(rows), flush=True)
    for r in rows:
        if "prefetch_speedup" in r:
            each = r["ratio_to_fsdp2_runs"]
            under = sum(v <= 1.0 for v in each)
            print(f"{r['ranks']} ranks: ZeRO-3 step without prefetch / with prefetch = "
                  f"{r['prefetch_speedup']:.2f}; ZeRO-3 prefetch / FSDP2 per run: "
                  f"{', '.join(f'{v:.2f}x' for v in each)} (at or under FSDP2 in {under} of "
                  f"{len(each)})", flush=True)
    return {"rows": rows, "units": {"step_s": "s", "bytes_per_rank": "bytes"}}
