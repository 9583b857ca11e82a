"""The Switch auxiliary loss (Fedus et al. 2021, eq. 4) against a written reference, and an empty
token group: a finite 0 that still reaches the router in backward, not 0/0 = NaN."""
import torch

from labkit.model import GPTConfig
from labkit.moe.layer import MoE, set_token_groups
from labkit.moe.router import route, switch_loss


def _reference(logits, k):
    """E * sum_i f_i P_i written out: f_i the share of the n*k choices that went to expert i."""
    n, E = logits.shape
    probs = torch.softmax(logits, -1)
    top = probs.topk(k, -1).indices
    f = torch.tensor([(top == i).sum().item() / (n * k) for i in range(E)])
    return E * sum(f[i] * probs[:, i].mean() for i in range(E))


def test_switch_loss_matches_the_written_formula():
    logits = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    got = switch_loss(route(logits, 2), 8)
    assert torch.allclose(got, _reference(logits, 2), rtol=1e-6)


def test_empty_group_gives_zero_not_nan():
    logits = torch.zeros(0, 8, requires_grad=True)
    aux = switch_loss(route(logits, 2), 8)
    assert aux.item() == 0.0
    aux.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_moe_layer_with_an_empty_capacity_group_is_finite():
    cfg = GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, n_expert=4, expert_top_k=2)
    torch.manual_seed(0)
    layer = MoE(cfg)
    x = torch.randn(1, 8, 16)
    set_token_groups(layer, [0, 8])
    y = layer(x)
    assert torch.isfinite(layer.aux) and torch.isfinite(y).all()
    layer.token_groups = None                            # one group of all 8
    layer(x)
    one_group = layer.aux
    set_token_groups(layer, [0, 8])
    layer(x)
    assert torch.allclose(layer.aux, one_group)          # the empty group weighs 0
    (layer.aux + y.sum()).backward()
    assert torch.isfinite(layer.router.weight.grad).all()
