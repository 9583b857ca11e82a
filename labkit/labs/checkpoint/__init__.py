"""Chapter 06 lab: exact resume (with and without RNG), resharding 4 -> 2, a straggler, a
frozen rank caught by a heartbeat.

    labkit run checkpoint --nproc 2
    torchrun --nproc-per-node 2 -m labkit run checkpoint

Rank 0 prints one table. Under torchrun every part runs on the torchrun world instead of
starting its own processes (the resharding row then saves and loads at that size).

Gloo only (BACKEND = "gloo"; `labkit run` hides the GPUs from it): the lesson is on the CPU:
bit-for-bit equal resumes need the CPU's deterministic kernels and RNG, and checkpoints are files.

Beside it, chapter 06's experiments (the algorithm is labkit.checkpoint's):
  resume       a tiny run that draws from every generator (this lab, train_ft, the checker)
  crash        SIGKILL a process mid-save and see what survives
  dcp_compare  the same state through torch.distributed.checkpoint (DCP), resharded
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from labkit import faults
from labkit.checkpoint import sharded as sh
from labkit.cliargs import ArgParser, count
from labkit.labs.checkpoint.resume import RunConfig, resume_jobs
from labkit.launch import run
from labkit.launch import under_torchrun as _under_torchrun
from labkit.progress import Progress

BACKEND = "gloo"  # a CPU lesson (see above): Gloo, even where there are GPUs


def _exact_resume(world: int, root: str) -> tuple:


    cfg = RunConfig()
    first = run(resume_jobs, world, args=(cfg, 10, 4, root, ("straight", "first")), echo=False)
    later = run(resume_jobs, world, args=(cfg, 10, 4, root, ("resume", "resume-no-rng")),
                echo=False)
    straight, resumed, no_rng = first[0][0][0], later[0][0][0], later[0][1][0]
    return (torch.equal(straight, resumed), torch.equal(straight, no_rng),
            (straight - no_rng).abs().max().item())


def _reshard_job(root: str, mode: str):


    rank, world = dist.get_rank(), dist.get_world_size()
    state = sh.demo_state()
    layout = sh.zero_layout(sh.shapes_of(state), world)
    if mode == "save":
        sh.save_sharded(root, 1, sh.shard_state(state, layout, rank), layout)
        return None
    got = sh.load_sharded(root, layout, rank)
    mine = sh.shard_state(state, layout, rank)
    return all(got[k].equal(v) for k, v in mine.items())


def main(argv=None) -> int:

    p = ArgParser(prog="labkit run checkpoint")
    p.add_argument("--nproc", type=count, default=2,
                   help="ranks (under torchrun: its world size)")
    p.add_argument("--folder", default=None, help="scratch folder shared by the ranks "
                   "(default: the system's temporary directory)")
    a = p.parse_args(argv)
    if a.folder is not None and not os.path.isdir(a.folder):
        raise ValueError(f"--folder {a.folder}: no such folder; make it first, or leave "
                         f"--folder out (the system's temporary directory)")
    world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else a.nproc
    prog = Progress("checkpoint", total=(0 if _under_torchrun() else 1) + 1
                    + (world >= 2) + (world >= 2 and not _under_torchrun()))
    rows = []
    # every rank must write into the same folder: under torchrun, name it after the run id
    base = a.folder or tempfile.gettempdir()
    if _under_torchrun():
        root = os.path.join(base, f"labkit-ch06-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
        os.makedirs(root, exist_ok=True)
    else:
        root = tempfile.mkdtemp(prefix="labkit-ch06-", dir=base)
    try:
        if not _under_torchrun():  # the resume needs fresh processes, which torchrun owns
            eq, eq_no_rng, diff = _exact_resume(world, f"{root}/resume")
            rows.append(("resume with RNG state: bitwise equal", eq))
            rows.append(("resume without RNG state: bitwise equal", eq_no_rng))
            rows.append(("  max weight difference without RNG", f"{diff:.3g}"))
            prog.done(f"exact resume: with RNG state equal={eq}, without equal={eq_no_rng}")
            save_world = 4
        else:
            save_world = world
        run(_reshard_job, save_world, args=(f"{root}/shard", "save"), echo=False)
        ok = run(_reshard_job, world, args=(f"{root}/shard", "load"), echo=False)
        rows.append((f"sharded save at {save_world}, load at {world}: equal", all(ok)))
        prog.done(f"resharding: saved at {save_world} ranks, loaded at {world}")
        if world >= 2:
            medians, found = run(faults.straggler_job, world, args=(world - 1, 3.0), echo=False)[0]
            rows.append((f"straggler (rank {world - 1} slowed 3x) found", [r for r, _ in found]))
            prog.done(f"straggler search: found ranks {[r for r, _ in found]}")
        if world >= 2 and not _under_torchrun():  # SIGSTOP under torchrun would stall its agent
            silent, delay, bound = run(faults.health_job, world,
                                       args=(f"{root}/hb", world - 1), echo=False)[0]
            rows.append((f"frozen rank {world - 1} reported", silent))
            rows.append(("  detected within the bound", delay <= bound + 0.5))
            prog.done(f"heartbeat: frozen rank {world - 1} reported after {delay:.1f} s")
    finally:
        if os.environ.get("RANK", "0") == "0":  # the last run() gathered: everyone is done
            shutil.rmtree(root, ignore_errors=True)
    if os.environ.get("RANK", "0") == "0":
        print(f"chapter 06 lab on {world} rank(s)")
        for what, value in rows:
            print(f"  {what:<46} {value}")
    return 0
