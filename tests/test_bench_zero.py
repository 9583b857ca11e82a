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
