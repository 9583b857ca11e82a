"""The chips table's Blackwell entries: dense peaks, HBM, NVLink and domain, each with a source."""
import pytest

from labkit.costs import chips, comm

BLACKWELL = ("B200 180GB", "GB200 (NVL72)", "GB300 (NVL72)")


@pytest.mark.parametrize("name", BLACKWELL)
def test_blackwell_entries_have_every_field_and_a_source(name):
    c = chips.chip(name)
    for dtype in ("bf16", "fp8", "fp4"):
        assert c.peak_flops(dtype) > 0
    assert c.peak_flops("fp8") == 2 * c.peak_flops("bf16")        # dense FP8 = 2x dense BF16
    assert c.capacity > 150e9 and c.bandwidth == 8e12
    assert c.nvlink == 900e9                                       # 1.8 TB/s both ways / 2
    assert c.nvlink_domain == (8 if name.startswith("B200") else 72)
    assert "sparsity" in c.source and "dense" in c.source and "NVLink" in c.source


def test_dense_is_half_the_sheets_sparse_rate():
    """GB200 NVL72: 360 PFLOPS BF16 with sparsity per 72 GPUs -> 2.5 PFLOPS dense per GPU."""
    assert chips.chip("GB200 (NVL72)").peak_flops("bf16") == pytest.approx(360e15 / 72 / 2)
    assert chips.chip("B200 180GB").peak_flops("fp8") == pytest.approx(72e15 / 8 / 2)
    assert chips.chip("GB300 (NVL72)").peak_flops("fp4") == pytest.approx(1080e15 / 72)


def test_every_sheet_has_a_domain_and_systems_name_real_chips():
    for name, c in chips.CHIPS.items():
        assert c.nvlink_domain in (8, 72) and c.nvlink and c.source, name
    for s in chips.SYSTEMS.values():
        c = chips.chip(s.gpu)
        assert s.nvlink_domain == c.nvlink_domain and s.nvlink_domain % s.gpus_per_node == 0
        assert s.nic > 0 and s.source
    assert "ASSUMED" in chips.chip("H800 80GB").source          # no NVIDIA sheet found


def test_nvlink5_is_twice_nvlink4_per_direction():
    nv5, nv4 = comm.LINKS["NVLink 5 (B200, GB200 NVL72)"], comm.LINKS["NVLink 4 (H100 SXM)"]
    assert nv5.bandwidth == 900e9 == 2 * nv4.bandwidth
