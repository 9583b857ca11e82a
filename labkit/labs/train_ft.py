"""A training run that survives a killed rank: checkpoint, die, restart, resume, same result.

    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29511 --nnodes 1 \\
        -m labkit.cli run train_ft --steps 12 --save-every 3 --kill-rank 1 --kill-step 7 \\
        --ckpt /tmp/ft --out /tmp/ft/params.pt
    labkit run train_ft --nproc 2 ...      # the same, restarted by labkit's own little loop

Rank `--kill-rank` SIGKILLs itself at the start of step `--kill-step` (first attempt only:
torchrun counts attempts in $TORCHELASTIC_RESTART_COUNT). Its peer is left inside an
all-reduce; torchrun's agent sees the dead worker, stops the others and starts every rank again
(a restart). Each fresh rank finds the newest committed checkpoint, loads it (weights,
optimizer, data position, RNG) and carries on; the parameters at the end equal those of a run
that was never interrupted, bit for bit. Without torchrun the lab restarts the ranks itself
(labkit.launch.run raises RankError when a rank dies; we launch again): the same contract.
"""
from __future__ import annotations

import argparse
import os
import signal

import torch


def ft_job(steps: int, save_every: int, kill_rank: int, kill_step: int, root: str, attempt: int,
           out: str | None = None):
    """One rank of the fault-tolerant run; returns (flat params, first step of this attempt)."""
    import torch.distributed as dist

    from labkit.checkpoint import atomic
    from labkit.checkpoint.full import load_full, save_full
    from labkit.checkpoint.resume import RunConfig, build, flat_params, train
    from labkit.launch import note

    cfg = RunConfig()
    rank = dist.get_rank()
    model, opt, data = build(cfg)
    start = 0
    if atomic.latest(root) is not None:  # a restart: resume from the newest whole checkpoint
        info = load_full(root, model, opt)
        data.load_state_dict(info["data"])
        start = info["step"]
    for step in range(start, steps):
        note(f"attempt {attempt}, step {step}")
        if attempt == 0 and rank == kill_rank and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no goodbye: a crashed machine
        train(model, opt, data, cfg, 1)
        if (step + 1) % save_every == 0 and step + 1 < steps:
            save_full(root, step + 1, model, opt, data_state=data.state_dict())
    params = flat_params(model)
    if out and rank == 0:
        atomic.write_bytes_atomic(out, _tensor_bytes(params))
    return params, start


def _tensor_bytes(t) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _init_for_attempt(attempt: int) -> None:
    """Join the process group under a key prefix unique to this attempt.

    torchrun keeps one key-value store across restarts; a fresh attempt that rendezvoused under
    the default keys would read the dead attempt's Gloo addresses and fail to connect."""
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"labkit-attempt{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main(argv=None) -> int:
    from labkit.launch import RankError, _under_torchrun, run

    p = argparse.ArgumentParser(prog="labkit run train_ft")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=7, help="-1: never kill")
    p.add_argument("--ckpt", required=True, help="checkpoint folder (empty at the first start)")
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    p.add_argument("--max-restarts", type=int, default=1, help="without torchrun only")
    a = p.parse_args(argv)
    job_args = (a.steps, a.save_every, a.kill_rank, a.kill_step, a.ckpt)
    if _under_torchrun():
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        world = int(os.environ["WORLD_SIZE"])
        _init_for_attempt(attempt)
        results = run(ft_job, world, args=(*job_args, attempt, a.out))
    else:
        for attempt in range(a.max_restarts + 1):
            try:
                results = run(ft_job, a.nproc, args=(*job_args, attempt, a.out), echo=False)
                break
            except RankError as err:
                print(f"attempt {attempt}: rank {err.rank} died; restarting from the last "
                      f"checkpoint", flush=True)
        else:
            raise SystemExit(f"gave up after {a.max_restarts} restart(s)")
    if os.environ.get("RANK", "0") == "0":
        start = results[0][1]
        print(f"finished {a.steps} steps; this attempt resumed at step {start}; "
              f"ranks agree: {all(torch.equal(results[0][0], r[0]) for r in results)}")
    return 0
