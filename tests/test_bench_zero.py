"""labkit bench zero on a tiny GPT at 3 ranks (shards that do not divide evenly): every labkit
variant's bytes held (by storage, counted after a real step) equal labkit.costs.memory's
prediction for its recipe. FSDP2 shards each parameter by rows (torch.chunk on dim 0), so its
largest rank, rank 0, holds ceil(rows/N) rows of each: a little more than the calculator's
Ψ/N, and exactly what that layout gives. Timings are never asserted on."""
import math

from labkit.bench import zero as bench
from labkit.model import GPT, GPTConfig

CFG = GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=18, tie_weights=False)


def test_every_variant_holds_what_its_layout_predicts():
    world = 3
    rows = bench.measure(world, CFG, steps=1, warmup=0)
    assert [r["variant"] for r in rows] == list(bench.VARIANTS)
    # FSDP2 (fp32 shards, gradients, Adam's m and v: 16 bytes an element), rank 0's row chunks
    fsdp2 = 16 * sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0])
                     for p in GPT(CFG).parameters())
    for r in rows:
        if r["variant"].startswith("torch FSDP2"):
            assert r["bytes_per_rank"] == fsdp2 > r["bytes_predicted"], r
        else:
            assert r["bytes_per_rank"] == r["bytes_predicted"], r
        assert r["cpu_bytes_per_rank"] == r["cpu_bytes_predicted"], r
        assert r["step_s"] > 0 and math.isfinite(r["ratio_to_torch_ddp"]), r
    offloaded = {r["variant"] for r in rows if r["cpu_bytes_per_rank"] > 0}
    assert offloaded == {"ZeRO-2 offload", "ZeRO-3 offload"}


def test_over_runs_reports_the_median_and_every_run():
    """The spread over runs (#39): median ratio, each run's ratio, bytes from the first run."""
    def run(step, fsdp):
        return [{"variant": "ZeRO-3 prefetch", "step_s": step, "ratio_to_torch_ddp": step,
                 "ratio_to_fsdp2": step / fsdp, "prefetch_speedup": 1.1, "bytes_per_rank": 7}]
    rows = bench.over_runs([run(1.0, 1.0), run(3.0, 2.0), run(2.0, 2.5)])
    (row,) = rows
    assert row["runs"] == 3 and row["step_s"] == 2.0 and row["bytes_per_rank"] == 7
    assert row["ratio_to_fsdp2_runs"] == [1.0, 1.5, 0.8] and row["ratio_to_fsdp2"] == 1.0
    assert "0.80-1.50x" in bench.table([dict(row, ranks=4, bytes_predicted=7,
                                             cpu_bytes_per_rank=0, cpu_bytes_predicted=0,
                                             bytes_ratio=1.0)])
