"""`labkit calibrate` and chip profiles: the measured rows against the formulas (fp32 activations
within 2%), a profile written and read back by labkit.costs.chips, the shipped H200 profile with
its provenance, and the calculators taking a measured chip wherever they take a GPU's name."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from labkit import calibrate, roofline
from labkit.calibrate import comm, memory, report, roofs
from labkit.costs import chips, flops
from labkit.costs import memory as costs_memory

QUICK_CFG, QUICK_BATCH, _ = calibrate.REFERENCE[("cpu", True)]


def _row(rows, start):
    return next(r for r in rows if r["component"].startswith(start))


def test_fp32_activation_rows_are_within_two_percent_of_the_formula():
    a = memory.activations(QUICK_CFG, QUICK_BATCH, "cpu", autocast=False)
    L = QUICK_CFG.n_layer
    for name in ("activations, one layer", f"activations, {L} layers",
                 "activations, logits kept for the loss"):
        r = _row(a["rows"], name)
        assert r["measured"] > 0 and r["ratio"] == pytest.approx(1.0, abs=0.02), r
    # what the formula has no term for is said, not hidden in a ratio
    assert _row(a["rows"], "activations, final norm and head inputs")["predicted"] is None


def test_autocast_rows_say_which_formula_they_are_against():
    a = memory.activations(QUICK_CFG, QUICK_BATCH, "cpu", autocast=True)
    assert a["recipe"] == "autocast bf16"
    has_recipe = "autocast" in costs_memory.RECIPES
    assert a["formula"] == ("formula: costs.memory autocast recipe" if has_recipe
                            else memory.PENDING)
    one = _row(a["rows"], "activations, one layer")
    fp32 = _row(memory.activations(QUICK_CFG, QUICK_BATCH, "cpu")["rows"],
                "activations, one layer")
    assert 0 < one["measured"] < fp32["measured"]        # bf16 matmul inputs: fewer bytes


def test_model_states_are_sixteen_bytes_per_parameter_measured():
    st = memory.states(QUICK_CFG, "cpu")
    rows = memory.state_rows(st)
    assert [r["ratio"] for r in rows[:2]] == [1.0, 1.0]          # params, grads: exact
    assert rows[2]["ratio"] == pytest.approx(1.0, abs=0.01)      # + AdamW's step counters
    total = sum(r["measured"] for r in rows) / st["n_params"]
    assert total == pytest.approx(16.0, abs=0.1)


def test_roofline_measures_sizes_that_reach_a_gpus_roof():
    assert max(roofline.sizes_of("cuda")) >= 8192
    assert roofline.sizes_of("cpu") == roofline.MATMUL_SIZES


def test_quick_roofs_on_the_cpu_have_no_fp8_and_say_why():
    r = roofs.measure("cpu", quick=True)
    assert r["peak_flops"]["fp32"] > 0 and r["bandwidth"] > 0
    assert r["fp8"] is None and "compute capability" in r["fp8_why_not"]
    rows = roofs.rows(r, None)
    assert all(row["datasheet"] is None and row["ratio"] is None for row in rows)
    h200 = chips.chip("H200 141GB")
    fake = dict(r, device="cuda")                       # the ratio's arithmetic, GPU units
    row = roofs.rows(fake, h200)[0]
    assert row["ratio"] == pytest.approx(r["peak_flops"]["fp32"] / h200.peak["fp32"])


def _result():
    """A calibrate() result with quick sections, its timing sections made up: cheap."""
    st = memory.states(QUICK_CFG, "cpu")
    step = {"recipe": "fp32, AdamW", "batch": 2, "seq": 64, "n_layer": 2, "hidden": 64,
            "step_s": 0.1, "steps": [0.1], "tokens_per_s": 1280.0, "model_flops": 1e9}
    return {"device": "cpu", "device_name": "CPU (test)", "cuda": False, "quick": True,
            "datasheet": None, "capacity": 8e9, "provenance": calibrate.provenance("cpu"),
            "config": {"n_embd": 64, "n_layer": 2, "n_head": 4, "block_size": 64},
            "roofs": {"device": "cpu", "matmuls": [["fp32", 128, 2e9]],
                      "copies": [["copy", 2**24, 3e9]], "peak_flops": {"fp32": 2e9},
                      "bandwidth": 3e9, "fp8": None, "fp8_why_not": "no GPU"},
            "memory": {"batch": 2, "states_how": st["how"], "n_params": st["n_params"],
                       "states": memory.state_rows(st), "activations": [
                           memory.activations(QUICK_CFG, QUICK_BATCH, "cpu")]},
            "compute": {"step": step, "dtype": "fp32", "mfu_measured": 0.5, "mfu_datasheet": None},
            "recompute": {"measured_factor": 1.3, "predicted_factor": 1.33, "flops_factor": 1.3,
                          "batch": 2},
            "comm": {"skipped": "--ranks 0"}, "seconds": 1.0}


def test_profile_round_trips_through_costs_chips(tmp_path, monkeypatch):
    res = _result()
    text = report.text(res)
    assert "n.a.: no datasheet" in text and "not measured (--ranks 0)" in text and "formula" in text
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(report.profile(res)))
    c = chips.load_profile(path)
    assert c.peak == {"fp32": 2e9} and c.bandwidth == 3e9 and c.capacity == 8e9
    assert c.provenance["torch"] == torch.__version__ and c.datasheet is None
    assert chips.chip(str(path)) == c
    monkeypatch.setenv(chips.PROFILE_ENV, str(path))
    assert chips.chip("measured") == c
    # the calculators take it wherever they take a GPU by name
    assert costs_memory.gpu_capacity("measured") == 8e9
    assert chips.chip("measured").ridge("fp32") == pytest.approx(2e9 / 3e9)
    saved = json.loads(path.read_text())
    assert saved["memory"]["states"][0]["measured"] > 0 and saved["recompute"]["batch"] == 2


def test_bad_profiles_and_names_are_refused_clearly(tmp_path, monkeypatch):
    monkeypatch.delenv(chips.PROFILE_ENV, raising=False)
    with pytest.raises(KeyError, match="LABKIT_CHIP_PROFILE"):
        chips.chip("measured")
    with pytest.raises(FileNotFoundError, match="labkit calibrate --json"):
        chips.load_profile(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": chips.PROFILE_FORMAT, "peak_flops": {"bf16": -1},
                               "bandwidth": 1.0}))
    with pytest.raises(ValueError, match="bf16 must be positive"):
        chips.load_profile(bad)
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a chip profile"):
        chips.load_profile(bad)


def test_the_measured_h200_sits_beside_its_datasheet_with_provenance():
    m, sheet = chips.chip("H200 141GB (measured)"), chips.chip("H200 141GB")
    assert m.datasheet == sheet.name and m.name not in chips.CHIPS    # CHIPS: datasheets only
    assert m.peak["bf16"] / sheet.peak["bf16"] == pytest.approx(0.80, abs=0.01)
    assert m.bandwidth / sheet.bandwidth == pytest.approx(0.90, abs=0.01)
    assert 1.70 <= m.peak["fp8"] / m.peak["bf16"] <= 1.80                  # not the sheet's 2x
    assert m.provenance["torch"].startswith("2.11") and m.provenance["cuda"] == "13.0"
    assert "shared/gpu/h200-2026-11-27-run1.json" in m.provenance["files"]
    assert flops.peak_flops("H200 141GB (measured)") == m.peak["bf16"]
    with open(chips.PROFILES / chips.MEASURED[m.name]) as f:
        d = json.load(f)["measurements"]
    mfu = [r["mfu_datasheet"] for r in d["gpt_autocast_bf16_fused_adamw_eager"]]
    assert 0.52 <= min(mfu) and max(mfu) <= 0.56
    assert d["recompute_every_block"]["bf16"]["measured_factor"] == pytest.approx(1.24, abs=0.01)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU this machine lacks")
def test_cli_refuses_cuda_without_a_gpu(capsys):
    assert calibrate.main(["--device", "cuda", "--quick"]) == 2
    assert "--device cpu" in capsys.readouterr().err
    assert calibrate.main(["--quick", "--json", "/no/such/folder/x.json"]) == 2
    assert "no folder /no/such/folder" in capsys.readouterr().err
    assert calibrate.main(["--ranks", "-1"]) == 2
    assert "--ranks" in capsys.readouterr().err


@pytest.mark.full
def test_calibrate_quick_end_to_end_writes_a_profile(tmp_path):
    out = tmp_path / "cal.json"
    r = subprocess.run([sys.executable, "-m", "labkit", "calibrate", "--quick", "--device", "cpu",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1. roofs" in r.stdout and "4. communication" in r.stdout
    c = chips.load_profile(out)
    assert c.peak["fp32"] > 0
    d = json.loads(out.read_text())
    fp32 = d["memory"]["activations"][0]["rows"]
    assert _row(fp32, "activations, one layer")["ratio"] == pytest.approx(1.0, abs=0.02)
    assert d["recompute"]["measured_factor"] > 0 and d["compute"]["mfu_measured"] > 0


@pytest.mark.full
def test_all_reduce_sweep_on_two_ranks_fits_alpha_beta():
    c = comm.sweep(2, comm.QUICK_SIZES, repeats=2)
    assert c["ranks"] == 2 and c["backend"] == "gloo" and len(c["rows"]) == 2
    assert all(r["busbw"] > 0 for r in c["rows"])
    assert (c["alpha"] is not None and c["bandwidth"] > 0) or c["fit_error"]


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="this torch has no _scaled_mm")
def test_fp8_path_runs_here_through_the_cpus_scaled_mm():
    """The GPU's FP8 code, run on the CPU's torch._scaled_mm (which accumulates in fp32 whatever
    use_fast_accum says): the shapes, the column-major operand and the scales are right, and the
    error against the exact product is fp32 rounding, not fp8's."""
    acc = roofs.fp8_accumulation(512, "cpu", m=64)
    assert acc["k"] == 512 and 0 <= acc["split"] < 1e-5 and 0 <= acc["fast"] < 1e-5
    rate = roofs.fp8_rate(128, "cpu", 0.01)
    assert rate["fp8_flops"] > 0 and rate["fp8_over_bf16"] == rate["fp8_flops"] / rate["bf16_flops"]


def test_the_planner_plans_with_measured_roofs():
    """The same plan on the H200's datasheet and on its measured roofs: compute takes
    sheet / measured = 989.5 / 796.2 times as long (the planner's FLOP rate is the chip's bf16)."""
    from labkit.costs import planner

    job = planner.Job("llama3-8b", global_batch=64, seq_len=4096)
    cfg = planner.Config(dp=8, tp=1, pp=1, zero=1)
    sheet, measured = (planner.evaluate(cfg, job, planner.Cluster(n_gpus=8, gpus_per_node=8,
                                                                  gpu=g)).compute_s
                       for g in ("H200 141GB", "H200 141GB (measured)"))
    ratio = chips.chip("H200 141GB").peak["bf16"] / chips.chip("H200 141GB (measured)").peak["bf16"]
    assert measured / sheet == pytest.approx(ratio, rel=1e-6)
