"""A training run that survives a killed rank: checkpoint, die, restart, resume, same result.

    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29511 --nnodes 1 \\
        -m labkit run train_ft --steps 12 --save-every 3 --kill-rank 1 --kill-step 7 \\
        --ckpt /tmp/ft --out /tmp/ft/params.pt
    labkit run train_ft --nproc 2 ...      # the same, restarted by labkit's own little loop

Rank `--kill-rank` SIGKILLs itself at the start of step `--kill-step` (first attempt only:
torchrun counts attempts in $TORCHELASTIC_RESTART_COUNT). Its peer is left inside an
all-reduce; torchrun's agent sees the dead worker, stops the others and starts every rank again
(a restart). Each fresh rank finds the newest committed checkpoint, loads it (weights,
optimizer, data position, RNG) and carries on; the parameters at the end equal those of a run
that was never interrupted, bit for bit. Without torchrun the lab restarts the ranks itself
(labkit.launch.run raises RankError when a rank dies; we launch again): the same contract.
At the end the lab trains the same run again without a kill or a checkpoint and compares the
final parameters bit for bit; it exits 1 if they differ.

Gloo only (BACKEND = "gloo"; `labkit run` hides the GPUs from it): the lesson is on the CPU:
a bit-for-bit equal resume relies on the CPU's deterministic kernels and its RNG state, and the
checkpoints are files; the lesson (kill, restart, resume) is the same on a GPU.
"""
from __future__ import annotations

import io
import os
import shutil
import signal
import tempfile

import torch
import torch.distributed as dist

from labkit.checkpoint import atomic
from labkit.checkpoint.full import load_full, save_full
from labkit.cliargs import ArgParser, at_least_zero, count
from labkit.labs.checkpoint.resume import RunConfig, build, flat_params, train
from labkit.launch import RankError, note, run
from labkit.launch import under_torchrun as _under_torchrun
from labkit.progress import Progress

BACKEND = "gloo"  # a CPU lesson (see above): Gloo, even where there are GPUs


def ft_job(steps: int, save_every: int, kill_rank: int, kill_step: int, root: str, attempt: int,
           out: str | None = None):
    """One rank of the fault-tolerant run; returns (flat params, first step of this attempt)."""


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


def compare_runs(results, reference) -> tuple:
    """(equal, max |difference|): every rank's final parameters against the uninterrupted
    run's, bit for bit (torch.equal: same shape, same dtype, same bits)."""
    same = all(torch.equal(r[0], ref[0]) for r, ref in zip(results, reference))
    same = same and len(results) == len(reference)
    diff = max(((r[0].double() - ref[0].double()).abs().max().item()
                if r[0].shape == ref[0].shape else float("inf"))
               for r, ref in zip(results, reference))
    return same, diff


def _tensor_bytes(t) -> bytes:

    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _default_ckpt() -> tuple:
    """(folder, made here): a fresh folder in the system's temporary directory. Under torchrun
    every rank, and every restarted attempt, must find the same one: it is named after the
    job's run id (TORCHELASTIC_RUN_ID), which torchrun keeps across restarts."""


    if _under_torchrun():
        root = os.path.join(tempfile.gettempdir(),
                            f"labkit-train_ft-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
        os.makedirs(root, exist_ok=True)
        return root, True
    return tempfile.mkdtemp(prefix="labkit-train_ft-"), True


def main(argv=None) -> int:


    p = ArgParser(prog="labkit run train_ft")
    p.add_argument("--nproc", type=count, default=2,
                   help="ranks (without torchrun; under it: its world size)")
    p.add_argument("--steps", type=count, default=12, help="training steps")
    p.add_argument("--save-every", type=count, default=3, help="steps between checkpoints")
    p.add_argument("--kill-rank", type=at_least_zero, default=1,
                   help="the rank that kills itself (below --nproc)")
    p.add_argument("--kill-step", type=int, default=7,
                   help="the step at whose start it does (-1: never kill)")
    p.add_argument("--ckpt", default=None, help="checkpoint folder (empty at the first start); "
                   "default: a fresh folder in the system's temporary directory, removed at the "
                   "end")
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    p.add_argument("--max-restarts", type=at_least_zero, default=1,
                   help="restarts after a dead rank (without torchrun; under it, torchrun's own)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", a.nproc)) if _under_torchrun() else a.nproc
    if a.kill_step >= 0 and a.kill_rank >= world:
        raise ValueError(f"--kill-rank {a.kill_rank} is not one of the {world} ranks; use "
                         f"--kill-rank {world - 1} (or --kill-step -1: no kill)")
    if a.kill_step < -1:
        raise ValueError(f"--kill-step {a.kill_step}: use a step from 0 to {a.steps - 1}, or -1 "
                         f"(never kill)")
    ckpt, temporary = (a.ckpt, False) if a.ckpt else _default_ckpt()
    prog = Progress("train_ft")
    prog.say(f"checkpoints in {ckpt}" + (" (temporary: removed at the end; --ckpt DIR keeps "
                                         "them)" if temporary else ""))
    job_args = (a.steps, a.save_every, a.kill_rank, a.kill_step, ckpt)
    attempts = []  # (attempt, what happened)
    try:
        if _under_torchrun():
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            world = int(os.environ["WORLD_SIZE"])
            if attempt:
                prog.say(f"attempt {attempt} (torchrun restarted every rank)")
            attempts += [(n, "a rank failed; torchrun restarted every rank")
                         for n in range(attempt)]
            results = run(ft_job, world, args=(*job_args, attempt, a.out))
            attempts.append((attempt, f"finished from step {results[0][1]}"))
        else:
            world = a.nproc
            for attempt in range(a.max_restarts + 1):
                try:
                    results = run(ft_job, a.nproc, args=(*job_args, attempt, a.out), echo=False)
                    attempts.append((attempt, f"finished from step {results[0][1]}"))
                    break
                except RankError as err:
                    attempts.append((attempt, f"rank {err.rank} died"))
                    prog.done(f"attempt {attempt}: rank {err.rank} died; restarting from the "
                              f"last checkpoint")
            else:
                raise SystemExit(f"gave up after {a.max_restarts} restart(s)")
        prog.done(f"attempt {attempts[-1][0]}: trained to step {a.steps}")
        # the claim is "resumed bit-exact": train the same run again, never interrupted, never
        # saved (same seed, same steps), and compare the final parameters bit for bit
        reference = run(ft_job, world, args=(a.steps, a.steps + 1, -1, -1,
                                             os.path.join(ckpt, "uninterrupted"), 0),
                        **({} if _under_torchrun() else {"echo": False}))
        prog.done(f"uninterrupted run of {a.steps} steps (the reference)")
    except BaseException:
        # under torchrun a restart may still need the checkpoints: keep them
        if temporary and not _under_torchrun():
            shutil.rmtree(ckpt, ignore_errors=True)
        raise
    if temporary and os.environ.get("RANK", "0") == "0":
        shutil.rmtree(ckpt, ignore_errors=True)  # the last run() gathered: every rank is done
    same, diff = compare_runs(results, reference)
    if os.environ.get("RANK", "0") == "0":
        start = results[0][1]
        agree = all(torch.equal(results[0][0], r[0]) for r in results)
        print(f"finished {a.steps} steps; this attempt resumed at step {start}; "
              f"ranks agree: {agree}")
        print(f"final parameters equal an uninterrupted run (same seed, same steps), bit for bit, "
              f"on every rank: {same}" + ("" if same else f" (max |difference| {diff:.3e})"))
        killed = (f"rank {a.kill_rank} killed at step {a.kill_step} on the first attempt"
                  if 0 <= a.kill_step < a.steps else "no rank killed")
        print(f"{world} ranks, {a.steps} steps, a checkpoint every {a.save_every}; {killed}")
        print(f"{'attempt':>7}  what happened")
        for n, what in attempts:
            print(f"{n:>7}  {what}")
    return 0 if same else 1
