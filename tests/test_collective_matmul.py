"""labkit.tp.collective_matmul on real Gloo processes: the ring-decomposed all-gather + matmul
gives the plain all-gather + matmul's output and the one-process product, at 2 and 3 ranks.
A few seconds (process start-up)."""
import pytest
import torch

from labkit.launch import run


def _job(m, k, n):
    import torch.distributed as dist

    from labkit.observe import commlog
    from labkit.tp.collective_matmul import allgather_matmul, collective_matmul

    rank = dist.get_rank()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(rank))       # cpu: Gloo test
    w = torch.randn(k, n, generator=torch.Generator().manual_seed(10 + rank))  # cpu: Gloo test
    with commlog.record() as log:
        overlapped = collective_matmul(x, w)
    return {"plain": allgather_matmul(x, w), "overlapped": overlapped, "x": x, "w": w,
            "sends": sum(e.op == "send" for e in log.events)}


@pytest.mark.parametrize("world", [2, 3])
def test_collective_matmul_equals_plain_and_the_one_process_product(world):
    m, k, n = 3, 5, 7                                   # odd sizes: no accidental symmetry
    rows = run(_job, world, args=(m, k, n), echo=False, timeout=60)
    x_full = torch.cat([r["x"] for r in rows])          # (world*m, k): every rank's rows
    for r in rows:
        torch.testing.assert_close(r["overlapped"], r["plain"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["overlapped"], x_full @ r["w"])
        assert r["sends"] == world - 1                  # one ring pass per step but the last
