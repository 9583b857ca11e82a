"""The planner's fast domain is a parameter: TP, EP and CP stay inside the NVLink domain, which is
8 GPUs on an HGX board and 72 in a GB200/GB300 NVL72 rack (costs.chips.SYSTEMS)."""
import pytest

from labkit.costs import chips, models
from labkit.costs import planner as P
from labkit.costs.planner.estimate import spans

# a DeepSeek-V3-shaped mixture: 256 experts, top-8, 61 layers of width 7168 (MHA, not MLA)
DS = models.ModelSpec("DeepSeek-V3-shaped", vocab_size=129280, hidden=7168, n_layers=61,
                      n_heads=128, ffn_hidden=2048, gated_mlp=True, n_experts=256, top_k=8,
                      seq_len=4096)
JOB = P.Job(DS, global_batch=1152, seq_len=4096)


def test_systems_carry_their_domain_and_links():
    hgx, nvl = P.system_cluster("HGX H100", 576), P.system_cluster("GB200 NVL72", 576)
    assert (hgx.domain, hgx.gpus_per_node, hgx.intra_bw) == (8, 8, 450e9)
    assert (nvl.domain, nvl.gpus_per_node, nvl.intra_bw) == (72, 4, 900e9)
    assert P.Cluster(64).domain == 8                       # no domain given: one node
    with pytest.raises(ValueError, match="whole number of NVLink domains of 72"):
        P.Cluster(100, 4, nvlink_domain=72)
    with pytest.raises(ValueError, match="nvlink_domain=6"):
        P.Cluster(48, 4, nvlink_domain=6)


def test_tp16_inside_an_nvl72_domain_and_not_on_hgx():
    """With 80 GB per GPU the best plan on an NVL72 rack is TP=16, inside the domain; on HGX H100
    no candidate has TP above 8 (the domain), so the same job never gets TP=16."""
    nvl = P.system_cluster("GB200 NVL72", 576, gpu_memory=80e9)
    best = P.plan(JOB, nvl)[0]
    assert best.config.tp == 16 and not spans(best.config, nvl)["tp"]
    assert "inside the NVLink domain of 72 GPUs" in P.reasons(best, JOB, nvl)[0]
    hgx = P.system_cluster("HGX H100", 576)
    configs, skipped = P.candidates(JOB, hgx)
    assert configs and max(c.tp for c in configs) == 8
    assert skipped["TP larger than the NVLink domain (TP stays on the fast links)"] > 0
    assert any(c.tp == 16 for c in P.candidates(JOB, nvl)[0])


def test_ep32_all_to_all_on_nvlink_inside_nvl72_over_the_nic_on_hgx():
    c = P.Config(dp=32, tp=2, pp=9, ep=32, zero=2)
    hgx, nvl = P.system_cluster("HGX H100", 576), P.system_cluster("GB200 NVL72", 576)
    assert spans(c, hgx)["ep"] and not spans(c, nvl)["ep"]
    on_hgx, on_nvl = P.evaluate(c, JOB, hgx), P.evaluate(c, JOB, nvl)
    # the same bytes at 900 GB/s against 50 GB/s: 18x less time for the bytes; the per-message
    # latencies (3 us on NVLink, 5 us on the NIC) are not 18x apart, so a little less in all
    assert 12 < on_hgx.ep_comm_s / on_nvl.ep_comm_s < 18
    assert "EP=32 inside the NVLink domain of 72" in "\n".join(P.reasons(on_nvl, JOB, nvl))
    assert "EP=32 across NVLink domains" in "\n".join(P.reasons(on_hgx, JOB, hgx))


def test_system_lookup_names_the_systems():
    with pytest.raises(KeyError, match="GB200 NVL72"):
        chips.system("NVL144")
