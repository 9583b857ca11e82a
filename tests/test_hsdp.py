"""HSDP (labkit.zero.hsdp): ZeRO-3 inside groups, replicas across them. Equal to one process on
parameters and first-step gradients (SGD and AdamW), on 4 ranks (2 x 2) and, in the full lane,
on 6 ranks as 2 x 3 and 3 x 2; equal to PyTorch's own HSDP (FSDP2's fully_shard on a 2-D mesh);
bytes on the wire per mesh dimension counted by the kernel against labkit.costs.zero; the
planner-side choice between FSDP and HSDP from link speeds (bad options: test_cli_validation).
The tiny model's widths (25, 5 heads) split unevenly in 2 and 3."""
import pytest

from labkit.check import ch03
from labkit.costs import zero as costs_zero
from labkit.labs.hsdp import hsdp_train, predicted
from labkit.labs.zero.train import TINY
from labkit.launch import run
from labkit.reference import TrainSpec, train
from labkit.testing import compare_dicts

STEPS = 2
BATCH = 12


def _everything(replicate: int, world: int):
    from labkit.labs.zero.fsdp import fsdp2_train

    out = {opt: hsdp_train(replicate, STEPS, BATCH, cfg=TINY, optimizer=opt, against_zero3=False)
           for opt in ("sgd", "adamw")}
    out["fsdp2"] = fsdp2_train(TINY, "adamw", steps=STEPS, batch_size=BATCH, replicate=replicate)
    out["lab"] = hsdp_train(replicate, 1, 2 * world, against_zero3=False)   # the lab's model
    return out


SIX = [pytest.param(p, marks=pytest.mark.full) for p in ((6, 2), (6, 3))]   # --full only


@pytest.fixture(scope="module", params=[(4, 2), *SIX], ids=lambda p: f"{p[1]}x{p[0] // p[1]}")
def runs(request):
    world, replicate = request.param
    per_rank = run(_everything, world, args=(replicate, world), timeout=240, echo=False)
    refs = {opt: train(TINY, TrainSpec(steps=STEPS, batch=BATCH, optimizer=opt)).as_dict()
            for opt in ("sgd", "adamw")}
    return world, replicate, per_rank, refs


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_hsdp_equals_one_process(runs, opt):
    world, replicate, per_rank, refs = runs
    results = [r[opt] for r in per_rank]
    what = f"HSDP {replicate} x {world // replicate}, {opt}"
    ch03.assert_matches_reference(results, refs[opt], what=what)
    ch03.assert_ranks_agree(results)
    for r in results:     # the mean gradient over all N ranks, as one process computes it
        compare_dicts(r["grads"], refs[opt]["grads"], what=f"{what}, first-step gradients")


def test_hsdp_equals_pytorchs_hsdp(runs):
    world, replicate, per_rank, refs = runs
    ch03.assert_matches_reference([r["fsdp2"] for r in per_rank], refs["adamw"],
                                  what="FSDP2 fully_shard on a 2-D mesh")
    for r in per_rank:    # the two against each other, at the reference's tolerance (AdamW on the
        # attention's key bias, whose gradient is zero up to rounding, amplifies rounding)
        theirs = {**r["fsdp2"], "losses": refs["adamw"]["losses"]}
        ch03.assert_matches_reference([r["adamw"]], theirs, what="labkit HSDP vs FSDP2's")


def test_bytes_per_mesh_dimension_counted_by_the_kernel_match_the_formula(runs):
    world, replicate, per_rank, _ = runs
    want = predicted(replicate, world)
    for r in per_rank:
        got = r["lab"]
        if got["shard_sent"] is None:
            pytest.skip(got["reason"])
        # Gloo adds small headers per message: a little over the formula, never under
        for dim in ("shard", "replicate"):
            assert 1.0 <= got[f"{dim}_sent"] / want[dim] < 1.03, (dim, got[f"{dim}_sent"], want)


def test_the_formula_reduces_to_zero3_and_to_ddp():
    psi = 1e9
    z3 = costs_zero.comm_per_rank(psi, 3, 8, bytes_per_value=4)["total"]
    assert costs_zero.hsdp_comm_per_rank(psi, 1, 8, 4, 4)["total"] == pytest.approx(z3)
    ddp = costs_zero.comm_per_rank(psi, 0, 8, bytes_per_value=4)["total"]
    assert costs_zero.hsdp_comm_per_rank(psi, 8, 1, 4, 4)["total"] == pytest.approx(ddp)
    with pytest.raises(ValueError, match="replicate must be a positive integer"):
        costs_zero.hsdp_comm_per_rank(psi, 0, 8)


def test_hsdp_wins_across_slow_links_and_loses_when_memory_is_short():
    # Llama-2-7B on 4 nodes x 8 GPUs: NVLink 4 (450 GB/s per GPU) inside, 400 Gb/s NIC across
    psi, nvlink, nic = 6.74e9, 450e9, 50e9
    choice = costs_zero.hsdp_or_fsdp(psi, 4, 8, nvlink, nic)
    assert choice["choice"] == "hsdp"
    assert choice["hsdp"]["seconds"] < choice["fsdp"]["seconds"] / 3
    # 16 bytes/param over 8 GPUs is 13.5 GB; with 10 GB for model states only FSDP fits
    tight = costs_zero.hsdp_or_fsdp(psi, 4, 8, nvlink, nic, memory_bytes=10e9)
    assert tight["choice"] == "fsdp"
    assert costs_zero.hsdp_or_fsdp(psi, 4, 8, nvlink, nic, memory_bytes=1e9)["choice"] is None
