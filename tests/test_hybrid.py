"""Lab 07: DP x TP on real processes equals the one-process GPT (losses, gradients, parameters)."""
import pytest

from labkit.labs.hybrid import DEFAULT_CFG, max_differences, reference, train_dp_tp
from labkit.launch import run
from labkit.topology import TopologyError

# fp32; AdamW divides by sqrt(v), which magnifies last-bit differences of tiny gradients, so the
# parameters after several steps get a looser bound than the first gradients
TOL = {"loss": 1e-5, "grads": 1e-6, "params": 1e-4}


@pytest.mark.parametrize("dp,tp,batch,optim", [(2, 2, 5, "adamw"), (3, 1, 7, "sgd")])
def test_dp_x_tp_equals_one_process(dp, tp, batch, optim):
    steps = 3
    results = run(train_dp_tp, dp * tp, args=(dp, tp, DEFAULT_CFG, steps, batch, 1e-2, optim),
                  echo=False)
    ref = reference(DEFAULT_CFG, steps, batch, 1e-2, optim)
    assert ref["losses"][-1] < ref["losses"][0]          # it trains, so equality means something
    for rank, res in enumerate(results):
        diff = max_differences(res, ref)
        for key, tol in TOL.items():
            assert diff[key] < tol, (rank, res["coords"], key, diff[key])
    # the four coordinates of a 2 x 2 grid each appear once
    assert len({(r["coords"]["dp"], r["coords"]["tp"]) for r in results}) == dp * tp


def test_wrong_degrees_are_refused_before_launch():
    from labkit.labs import hybrid

    with pytest.raises(TopologyError, match="2 x 2 = 4, but the world has 3"):
        hybrid.main(["--nproc", "3", "--dp", "2", "--tp", "2"])


def test_dp_x_pp_equals_one_process():
    from labkit.labs.hybrid import train_dp_pp
    from labkit.model import GPTConfig
    from labkit.pipeline.executor import reference_step

    results = run(train_dp_pp, 4, args=(2, 2, DEFAULT_CFG, 5, 2), echo=False)   # rows 3 + 2
    ref = reference_step(GPTConfig(**DEFAULT_CFG), 5)
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert len(losses) == 2 and all(abs(v - ref["loss"].item()) < 1e-5 for v in losses)
    covered = set()
    for r in results:
        for name, g in r["grads"].items():
            assert (g - ref["grads"][name]).abs().max().item() < 1e-6, (r["coords"], name)
            covered.add(name)
    assert covered == set(ref["grads"])                 # the stages together own every parameter


def _hybrid_watched(dp, tp, pp):
    """The lab's rank functions, watched for tensors made without device= (they would stay on
    the CPU on a GPU rank; tests/devicecheck.py)."""
    from devicecheck import RANK_SIDE, ImplicitDevice
    from labkit.labs.hybrid import train_dp_pp

    with ImplicitDevice(RANK_SIDE) as mode:
        if pp > 1:
            res = train_dp_pp(dp, pp, DEFAULT_CFG, 3, pp)
        else:
            res = train_dp_tp(dp, tp, DEFAULT_CFG, 1, 3)
    return mode.calls, res["ran_on"]


@pytest.mark.parametrize("dp,tp,pp", [(1, 2, 1), (1, 1, 2)])
def test_rank_code_names_the_device_of_every_tensor(dp, tp, pp):
    for calls, ran_on in run(_hybrid_watched, dp * tp * pp, args=(dp, tp, pp), echo=False):
        assert calls == [], f"tensors made without device=: {calls}"
        assert ran_on == ("gloo", "cpu")
