"""Chapter 06: exact resume, atomic writes, bad-input errors, sharded resharding, async save."""
import json

import pytest
import torch

from labkit.check.ch06 import assert_resume_matches, assert_round_trip, assert_weights_only
from labkit.checkpoint import atomic
from labkit.checkpoint.errors import (
    CorruptCheckpointError,
    LayoutError,
    MissingShardError,
    WrongModelError,
)
from labkit.checkpoint.full import load_full, save_full
from labkit.labs.checkpoint.resume import RunConfig, build, resume_jobs, train
from labkit.launch import run

CFG = RunConfig()


def _resume_all(world, root):
    """Straight, interrupted+resumed, and resumed-without-RNG runs at one world size."""
    first = run(resume_jobs, world, args=(CFG, 10, 4, root, ("straight", "first")), echo=False)
    # a fresh set of processes resumes, as after a crash
    later = run(resume_jobs, world, args=(CFG, 10, 4, root, ("resume", "resume-no-rng")),
                echo=False)
    return ([f[0] for f in first], [r[0] for r in later], [r[1] for r in later])


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_bitwise_identical_and_diverges_without_rng(world, tmp_path):
    straight, resumed, no_rng = _resume_all(world, str(tmp_path))
    # the exercise checker's own assertions (shared): equal with RNG, different without
    assert_resume_matches([[s] for s in straight], [[r] for r in resumed], world)
    assert_resume_matches([[s] for s in straight], [[n] for n in no_rng], world, expect_equal=False)
    assert straight[0][1][4:] == resumed[0][1], "losses after the resume differ"
    if world == 2:
        assert torch.equal(straight[0][0], straight[1][0]), "replicas drifted apart"


def test_bad_inputs_raise_clear_errors_and_keep_files(tmp_path):
    model, opt, data = build(CFG)
    train(model, opt, data, CFG, 2)
    save_full(tmp_path, 2, model, opt, data_state=data.state_dict())
    ckpt = atomic.latest(tmp_path)
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    other, other_opt, _ = build(RunConfig(n_embd=24))
    with pytest.raises(WrongModelError, match="another model"):
        load_full(tmp_path, other, other_opt)
    with pytest.raises(LayoutError, match="random state of 1 rank"):
        _fake_world(tmp_path, model, opt)
    # truncated and corrupted copies of the checkpoint, in their own roots
    for how, match in [("truncate", "truncated"), ("flip", "corrupted")]:
        bad_root = tmp_path / how
        bad = bad_root / ckpt.name
        bad.mkdir(parents=True)
        for n, b in before.items():
            (bad / n).write_bytes(b)
        atomic.write_bytes_atomic(bad_root / "latest", ckpt.name.encode())
        raw = bytearray(before["model.pt"])
        if how == "truncate":
            raw = raw[: len(raw) // 2]
        else:
            raw[len(raw) // 2] ^= 0xFF
        (bad / "model.pt").write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpointError, match=match):
            load_full(bad_root, model, opt)
    # a file that is not a weights-only torch file at all (even with no checksum to compare)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        atomic.load_file(tmp_path / "junk.pt")
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before, "a failed load touched files"


def _fake_world(root, model, opt):
    """load_full as rank 0 of a 2-rank job, without starting one: the world check comes first."""
    import labkit.checkpoint.full as full

    real = full.rank_world
    full.rank_world = lambda group=None: (0, 2)
    try:
        return load_full(root, model, opt)
    finally:
        full.rank_world = real


def test_sigkill_during_save_leaves_previous_checkpoint(tmp_path):
    from labkit.labs.checkpoint.crash import crash_during_save

    crash_during_save(tmp_path, atomic=True)
    assert (tmp_path / ".step_00000002.tmp").is_dir(), \
        "the killed save should leave its temp folder"
    assert atomic.latest(tmp_path).name == "step_00000001"
    model, opt, _ = build(CFG)
    info = load_full(tmp_path, model, opt)
    fresh, _, _ = build(CFG)
    assert info["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


# ----------------------------------------------------------------------------- sharded
from labkit.checkpoint import sharded as sh  # noqa: E402


def _reshard_job(root, ops, dcp_in=None, dcp_out=None):
    """Run ("load"|"save", "zero"|"tp", step) ops on this rank. A save writes the pieces last
    loaded under the same layout kind (a real chain), or cuts them from the demo state."""
    import torch.distributed as dist

    from labkit.checkpoint.full import rank_world
    from labkit.labs.checkpoint.dcp_compare import dcp_load, dcp_save

    rank, world = rank_world()
    state = sh.demo_state()
    shapes, split = sh.shapes_of(state), sh.tp_split_of(state)
    make = {"zero": lambda: sh.zero_layout(shapes, world),
            "tp": lambda: sh.tp_layout(shapes, world, split)}
    got, last = {}, {}
    for op, kind, step in ops:
        layout = make[kind]()
        if op == "load":
            got[(kind, step)] = last[kind] = sh.load_sharded(f"{root}/{sh.atomic.step_name(step)}",
                                                             layout, rank)
        else:
            sh.save_sharded(root, step, last.get(kind) or sh.shard_state(state, layout, rank),
                            layout)
    dcp = dcp_load(shapes, f"{root}/{dcp_in}") if dcp_in else None
    if dcp_out and dist.is_initialized():
        dcp_save(state, f"{root}/{dcp_out}")
    return got, dcp


def _check_loaded(results, world, state):
    shapes, split = sh.shapes_of(state), sh.tp_split_of(state)
    for key in results[0][0]:
        kind = key[0]
        layout = (sh.zero_layout(shapes, world) if kind == "zero"
                  else sh.tp_layout(shapes, world, split))
        whole = sh.assemble_local([r[0][key] for r in results], layout)
        for k, v in state.items():
            assert torch.equal(whole[k], v), f"{key} at {world} ranks: {k} differs"
    for r in results:
        if r[1] is not None:
            assert all(torch.equal(r[1][k], v) for k, v in state.items()), "DCP load differs"


def test_sharded_resharding_chain_4_2_1_4_zero_and_tp_and_dcp(tmp_path):
    root, state = str(tmp_path), sh.demo_state()
    run(_reshard_job, 4, args=(root, [("save", "zero", 1), ("save", "tp", 2)], None, "dcp4"),
        echo=False)
    two = run(_reshard_job, 2, args=(root, [("load", "zero", 1), ("save", "zero", 3),
                                            ("load", "tp", 2), ("save", "tp", 5)], "dcp4"),
              echo=False)
    _check_loaded(two, 2, state)
    one = [_reshard_job(root, [("load", "zero", 3), ("save", "zero", 4), ("load", "tp", 5)])]
    _check_loaded(one, 1, state)
    # TP-saved weights load into a ZeRO layout too: both are boxes of the same tensors
    cross = sh.load_sharded(f"{root}/step_00000005", sh.zero_layout(sh.shapes_of(state), 1), 0)
    _check_loaded([({("zero", 5): cross}, None)], 1, state)
    four = run(_reshard_job, 4, args=(root, [("load", "zero", 4), ("load", "tp", 5)]), echo=False)
    _check_loaded(four, 4, state)
    meta = json.loads((tmp_path / "step_00000001" / "meta.json").read_text())
    assert meta["world"] == 4 and len(meta["layout"]["pieces"]) == 4 * len(state)


def test_sharded_errors(tmp_path):
    state = sh.demo_state()
    shapes = sh.shapes_of(state)
    layout = sh.zero_layout(shapes, 1)
    sh.save_sharded(tmp_path, 1, sh.shard_state(state, layout, 0), layout)
    with pytest.raises(LayoutError, match="3 tensor-parallel ranks cannot split"):
        sh.tp_layout(shapes, 3, sh.tp_split_of(state))
    other = sh.shapes_of(sh.demo_state(n_embd=8, n_head=2))
    with pytest.raises(WrongModelError, match="another model"):
        sh.load_sharded(tmp_path, sh.zero_layout(other, 1), 0)
    (tmp_path / "step_00000001" / "shard_rank0.pt").unlink()
    with pytest.raises(MissingShardError, match="shard_rank0.pt .rank 0 of 1. is missing"):
        sh.load_sharded(tmp_path, layout, 0)


# ----------------------------------------------------------------------------- async
def test_async_save_snapshots_and_keeps_one_in_flight(tmp_path):
    import threading

    from labkit.checkpoint.async_save import AsyncSaver, save_local

    gates = {1: threading.Event(), 2: threading.Event()}
    order = []

    def slow_write(step):
        def write(snap):
            gates[step].wait(10)  # each write is held until the test lets it go
            save_local(tmp_path, step, snap)
            order.append(step)
        return write

    state = {"w": torch.zeros(1000)}
    saver = AsyncSaver()
    saver.save(state, slow_write(1))
    state["w"].add_(1.0)  # training changes the weights while the save is in flight
    assert saver.in_flight
    threading.Timer(0.3, gates[1].set).start()
    saver.save(state, slow_write(2))  # must wait for save 1 to finish: one in flight
    # save 2 is still held by its own gate, so only save 1 can have committed here (a shared
    # gate let save 2 finish too on a loaded machine before this line ran)
    assert order == [1], "the second save started before the first was committed"
    gates[2].set()
    saver.wait()
    assert order == [1, 2]
    one = atomic.load_file(tmp_path / "step_00000001" / "state.pt")
    two = atomic.load_file(tmp_path / "step_00000002" / "state.pt")
    assert torch.equal(one["w"], torch.zeros(1000)), "the snapshot must be taken at save() time"
    assert torch.equal(two["w"], torch.ones(1000))
    assert atomic.latest(tmp_path).name == "step_00000002"

    def broken(snap):
        raise OSError("disk full")
    saver.save(state, broken)
    with pytest.raises(RuntimeError, match="disk full"):
        saver.wait()


def test_activation_checkpointing_keeps_only_block_inputs_and_same_gradients():
    from labkit.checkpoint.activation import measure, with_recompute
    from labkit.model import GPT, GPTConfig, get_batch, tiny_corpus

    cfg = GPTConfig(n_layer=3, n_embd=32, n_head=4, block_size=32)
    m = measure(cfg, batch=4, repeats=1)
    assert (m["recompute"]["per_block_bytes"] == m["predicted_block_bytes_recompute"]
            == 4 * 32 * 32 * 4)
    assert m["plain"]["per_block_bytes"] > 8 * m["recompute"]["per_block_bytes"]
    assert m["plain"]["other_bytes"] == m["recompute"]["other_bytes"]
    # counted by torch: one more forward of the blocks (not of the head and loss), so above 1 and
    # at most (f + 2f + f)/(f + 2f) = 4/3 of the FLOPs; op calls grow by at least as much
    assert 1.1 < m["flops_factor"] <= 4 / 3 and m["ops_factor"] >= m["flops_factor"]
    x, y = get_batch(tiny_corpus(), 4, 32, step=1)
    a, b = GPT(cfg), GPT(cfg)
    with_recompute(b)
    for model in (a, b):
        model(x, y)[1].backward()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), f"{n}: recomputation changed the gradient"


def test_checker_helpers_catch_incomplete_rng_capture():
    from labkit.checkpoint.rng import rng_state, set_rng_state

    assert_round_trip(rng_state, set_rng_state)
    assert_weights_only(rng_state)
    torch_only = (lambda: {"torch": torch.get_rng_state()},
                  lambda s: torch.set_rng_state(s["torch"]))
    with pytest.raises(AssertionError, match="Python's random"):
        assert_round_trip(*torch_only)
    import numpy as np
    with pytest.raises(AssertionError, match="weights_only"):
        assert_weights_only(lambda: {"numpy": np.random.get_state()})


def test_naive_save_killed_midway_loses_the_checkpoint(tmp_path):
    from labkit.labs.checkpoint.crash import crash_during_save

    crash_during_save(tmp_path, atomic=False)
    with pytest.raises(CorruptCheckpointError, match="cannot be read"):
        atomic.load_file(tmp_path / "ckpt.pt")


def test_costs_checkpoint_young_is_the_minimum_of_the_waste():
    from labkit import costs

    ck = costs.checkpoint
    assert ck.checkpoint_bytes(70e9) == 980e9  # 14 bytes/param: gradients are not saved
    assert ck.save_time(980e9, 512, 2.0, 100.0) == pytest.approx(9.8)
    delta, M = 30.0, 50 * 3600.0
    grid = [60.0 * k for k in range(1, 600)]
    best = min(grid, key=lambda t: ck.waste_fraction(t, delta, M))
    assert abs(best - ck.young_interval(delta, M)) <= 60.0
    assert ck.daly_interval(delta, M) == pytest.approx(ck.young_interval(delta, M), rel=0.02)
    assert ck.daly_interval(3 * M, M) == M
    assert ck.recompute_time_factor(2.0) == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match="unknown recipe"):
        ck.bytes_per_param("fp8_magic")


def test_train_ft_compares_the_resumed_run_with_an_uninterrupted_one_bit_for_bit():
    from labkit.labs.train_ft import compare_runs

    a = torch.linspace(-1, 1, 7, dtype=torch.float64)
    same, diff = compare_runs([(a, 0), (a.clone(), 0)], [(a.clone(), 0), (a.clone(), 0)])
    assert same and diff == 0.0
    b = a.clone()
    b[3] = torch.nextafter(b[3], torch.tensor(2.0, dtype=torch.float64))  # one ulp: not equal
    same, diff = compare_runs([(a, 0), (b, 0)], [(a, 0), (a, 0)])
    assert not same and 0 < diff < 1e-15
    same, _ = compare_runs([(a.float(), 0)], [(a, 0)])  # same values, another dtype: not bitwise
    assert not same
