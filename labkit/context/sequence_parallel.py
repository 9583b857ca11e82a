"""Megatron sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, arXiv:2205.05198): tensor parallelism with the rest of the layer split
along the sequence.

    from labkit.context.sequence_parallel import apply_sp
    model = apply_sp(GPT(cfg, seed=0), group)   # in place; tp = group size, T % tp == 0
    logits, loss = model(x, y)                  # x: the whole (B, T) tokens on every rank

Tensor parallelism splits the attention core and the MLP, but the layer norms, dropouts and
residual adds between them run on the whole (B, T, h) activations on every rank: tp copies of
the same work and the same saved bytes. Sequence parallelism cuts those regions along the
sequence instead, each rank keeping (B, T/tp, h). Megatron's f and g then change:

    entering a column-parallel layer:  all-gather over the sequence   (backward: reduce-scatter)
    leaving a row-parallel layer:      reduce-scatter over the sequence (backward: all-gather)

An all-reduce is a reduce-scatter followed by an all-gather, so the pair moves TP's bytes
(measured in tests/test_context.py by the kernel's socket counters). The activations of the
norm/residual regions are divided by tp. So are the inputs of the column-parallel layers if,
as Megatron-LM does (regather=True, the default), each keeps only its sequence chunk for
backward and all-gathers it again there: then every activation a block saves is / tp (measured
with saved-tensor hooks: exactly 1/tp of the one-process block), for two more all-gathers a
layer in backward (1.25x TP's bytes). Megatron launches that all-gather before the dX = dY W
product and overlaps it with it; the reduce-scatter of dX then overlaps the dW product
(megatron/core/tensor_parallel/layers.py, LinearWithGradAccumulationAndAsyncCommunication).
regather=False keeps TP's bytes and the whole (B, T, h) column inputs: not both.
On Gloo the reduce-scatter is labkit's ring (labkit.zero.shard.reduce_scatter_sum): Gloo's own
moves all-reduce bytes.

Parameters used inside the sequence-split region (both layer norms and the biases added after
the reduce-scatter) see only this rank's tokens, so their gradients are partial sums: each is
used through Megatron's f (identity forward, all-reduce of the gradient backward), which Megatron
itself does as one bucketed all-reduce after backward. The embedding, final norm and head stay
replicated: the sequence is scattered after the embedding and gathered before the final norm.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.flat import reduce_scatter_sum
from labkit.layers import MLP
from labkit.observe import commlog
from labkit.tp.blocks import TensorParallelAttention, TensorParallelMLP
from labkit.tp.gpt import apply_tp
from labkit.tp.operators import conjugate, f, world_of


def check_sequence(T: int, tp: int) -> None:
    if T % tp:
        lo, hi = (T // tp) * tp, (T // tp + 1) * tp
        raise ValueError(f"sequence parallelism splits the sequence over the tensor-parallel "
                         f"group: sequence length T={T} is not divisible by tp={tp}; use T a "
                         f"multiple of {tp} (e.g. {lo or hi} or {hi}) or a tp that divides {T}")


# ----------------------------------------------------------------------------- the collectives
# Megatron keeps activations sequence-first (T, B, h) so that a sequence chunk is one contiguous
# block of memory; the book's model is (B, T, h), so each collective transposes on the way.
def _all_gather_seq(x, group, where):                        # (B, T/tp, h) -> (B, T, h)
    _, tp = world_of(group)
    if tp == 1:
        return x
    mine = x.transpose(0, 1).contiguous()                    # (T/tp, B, h)
    out = mine.new_empty(tp * mine.numel())                  # (T * B * h,)
    commlog.all_gather_into(out, mine.view(-1), group=group, where=where)
    return out.view(tp * mine.shape[0], *mine.shape[1:]).transpose(0, 1)  # (B, T, h)


def _reduce_scatter_seq(x, group, where):                    # (B, T, h) -> (B, T/tp, h)
    _, tp = world_of(group)
    if tp == 1:
        return x
    check_sequence(x.shape[1], tp)
    full = x.transpose(0, 1).contiguous()                    # (T, B, h)
    mine = reduce_scatter_sum(full.view(-1), group, where)   # (T/tp * B * h,) summed over ranks
    return mine.view(full.shape[0] // tp, *full.shape[1:]).transpose(0, 1)  # (B, T/tp, h)


def _split_seq(x, group):                                    # (B, T, h) -> (B, T/tp, h)
    rank, tp = world_of(group)
    check_sequence(x.shape[1], tp)
    n = x.shape[1] // tp
    return x[:, rank * n:(rank + 1) * n].contiguous()


# Each pair is Megatron's f/g idea along the sequence: one collective forward, its conjugate back.
def gather_sequence(x, group):
    """(B, T/tp, h) -> (B, T, h): all-gather forward, reduce-scatter backward (SP's f). Before a
    column-parallel layer: each rank's column slice gives a partial dL/dx for every token, and
    the sum of a token's partials belongs to the rank that holds the token."""
    return conjugate(x, lambda t: _all_gather_seq(t, group, "SP all-gather forward"),
                     lambda grad: _reduce_scatter_seq(grad, group, "SP reduce-scatter backward"))


def reduce_scatter_sequence(x, group):
    """(B, T, h) partial sums -> (B, T/tp, h) summed: reduce-scatter forward, all-gather backward
    (SP's g, after a row-parallel layer)."""
    return conjugate(x, lambda t: _reduce_scatter_seq(t, group, "SP reduce-scatter forward"),
                     lambda grad: _all_gather_seq(grad.contiguous(), group,
                                                  "SP all-gather backward"))


def scatter_sequence(x, group):
    """(B, T, h) whole on every rank -> this rank's (B, T/tp, h); backward all-gathers (the
    replicated embedding before the first block wants the whole gradient on every rank)."""
    return conjugate(x, lambda t: _split_seq(t, group),
                     lambda grad: _all_gather_seq(grad.contiguous(), group, "SP scatter backward"))


def gather_whole(x, group):
    """(B, T/tp, h) -> (B, T, h) for replicated layers after it; backward keeps my chunk (the
    final norm and head are replicated, so every rank already holds the whole, same gradient)."""
    return conjugate(x, lambda t: _all_gather_seq(t, group, "SP gather for the head"),
                     lambda grad: _split_seq(grad, group))


# ----------------------------------------------------------------------------- the layers
def _norm(ln: nn.LayerNorm, x, group):
    """A layer norm on this rank's tokens; its weight and bias through f (gradients summed)."""
    w = None if ln.weight is None else f(ln.weight, group)
    b = None if ln.bias is None else f(ln.bias, group)
    return F.layer_norm(x, ln.normalized_shape, w, b, ln.eps)


def _row_out(layer, y, group):
    """A row-parallel layer's partial output, reduce-scattered, plus its bias (through f)."""
    y = reduce_scatter_sequence(F.linear(y, layer.weight), group)  # (B, T/tp, h)
    return y if layer.bias is None else y + f(layer.bias, group)


class _GatherLinear(torch.autograd.Function):
    """[all-gather(x) @ W_i^T + b_i for each layer i] that saves only this rank's x (B, T/tp, h)
    and all-gathers it again in backward for the dW_i (Korthikanti et al. section 4.2.2;
    Megatron-LM launches that all-gather before the dX = dY W product and overlaps it with it).
    Keeps (tp-1)/tp less of the input, for one more all-gather per column-parallel entry in
    backward."""

    @staticmethod
    def forward(ctx, x, group, n, *params):                  # params: W_1..W_n, then b_1..b_n
        ctx.group, ctx.n = group, n
        ws, bs = params[:n], params[n:]
        ctx.has_bias = bool(bs)
        ctx.save_for_backward(x, *ws)                        # the local shard and the weights
        full = _all_gather_seq(x, group, "SP all-gather forward")      # (B, T, h)
        return tuple(F.linear(full, w, bs[i] if bs else None) for i, w in enumerate(ws))

    @staticmethod
    def backward(ctx, *grads):                               # each (B, T, out_i/tp)
        x, *ws = ctx.saved_tensors
        full = _all_gather_seq(x, ctx.group, "SP re-gather backward").flatten(0, -2)  # (B*T, h)
        g2 = [g.flatten(0, -2) for g in grads]               # (B*T, out_i/tp)
        dws = [g.t() @ full for g in g2]                     # (out_i/tp, h)
        dbs = [g.sum(0) for g in g2] if ctx.has_bias else []
        dx = sum(g @ w for g, w in zip(grads, ws))           # (B, T, h) partial over ranks
        dx = _reduce_scatter_seq(dx, ctx.group, "SP reduce-scatter backward")
        return (dx, None, None, *dws, *dbs)


def gather_linear(x, group, *weights):
    """SP's column-parallel entry the Megatron way: all-gather(x) @ W_i^T for each weight, keeping
    only this rank's (B, T/tp, h) chunk for backward and all-gathering it again there (one more
    all-gather than `gather_sequence(x) @ W^T`, which keeps the gathered (B, T, h))."""
    return _GatherLinear.apply(x, group, len(weights), *weights)


def _column(layers, x, group, regather: bool):
    """One or more column-parallel layers (sharing the input) on this rank's sequence chunk:
    (B, T/tp, h) -> one (B, T, out_i/tp) per layer. The all-gather happens once for all."""
    if not regather:
        full = gather_sequence(x, group)                     # (B, T, h), kept for backward
        return [F.linear(full, p.weight, p.bias) for p in layers]
    biases = [] if layers[0].bias is None else [p.bias for p in layers]
    return _GatherLinear.apply(x, group, len(layers), *[p.weight for p in layers], *biases)


class SequenceParallelAttention(TensorParallelAttention):
    """TensorParallelAttention whose input and output are this rank's sequence chunk."""

    regather = True

    def forward(self, x):                                    # (B, T/tp, h)
        group = self.q_proj.group
        B, T = x.shape[0], x.shape[1] * dist.get_world_size(group)
        q, k, v = (self._heads(t, B, T) for t in
                   _column([self.q_proj, self.k_proj, self.v_proj], x, group, self.regather))
        if k.shape[1] != q.shape[1]:                         # q (B, nh/tp, T, d), k/v nkv/tp
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, -1)              # (B, T, nh/tp * d)
        return _row_out(self.o_proj, y, group)               # (B, T/tp, h)


class SequenceParallelMLP(TensorParallelMLP):
    regather = True

    def forward(self, x):                                    # (B, T/tp, h)
        group = self.fc.group
        (x,) = _column([self.fc], x, group, self.regather)   # (B, T, 4h/tp)
        return _row_out(self.proj, F.gelu(x), group)         # (B, T/tp, h)


class SequenceParallelBlock(nn.Module):
    """A pre-norm block on (B, T/tp, h); the first one scatters the whole sequence it is given."""

    def __init__(self, block, group, scatter_input: bool, regather: bool = True):
        super().__init__()
        self.ln_1, self.ln_2 = block.ln_1, block.ln_2        # same names: same state_dict keys
        self.attn = SequenceParallelAttention(block.attn.q_proj, block.attn.k_proj,
                                              block.attn.v_proj, block.attn.o_proj,
                                              block.attn.head_dim)
        self.mlp = SequenceParallelMLP(block.mlp.fc, block.mlp.proj)
        self.attn.regather = self.mlp.regather = regather
        self.group, self.scatter_input = group, scatter_input

    def forward(self, x):                            # (B, T, h) first block, else (B, T/tp, h)
        if self.scatter_input:
            x = scatter_sequence(x, self.group)              # (B, T/tp, h)
        x = x + self.attn(_norm(self.ln_1, x, self.group))
        return x + self.mlp(_norm(self.ln_2, x, self.group))


class GatheringLayerNorm(nn.LayerNorm):
    """The final norm, preceded by the sequence all-gather (same parameters, same names)."""

    def forward(self, x):                                    # (B, T/tp, h) -> (B, T, h)
        return super().forward(gather_whole(x, self.group))


def apply_sp(model, group=None, regather: bool = True):
    """labkit.tp.apply_tp, then every block's norms and residuals on T/tp tokens. In place.

    regather=True (Megatron-LM's way): a column-parallel layer keeps only this rank's chunk of
    its input for backward and all-gathers it again there: activations / tp as Korthikanti's
    formula has it, one more all-gather per column entry in backward. regather=False keeps the
    gathered input: exactly TP's bytes on the wire, the (B, T, h) inputs of q/k/v and fc kept.

    model.forward still takes the whole (B, T) tokens: the first block scatters the sequence after
    the embedding, the final norm gathers it; logits and loss are whole on every rank."""
    if any(not isinstance(b.mlp, MLP) for b in model.blocks):
        raise ValueError("apply_sp shards dense MLPs; a mixture-of-experts layer would need its "
                         "tokens gathered first (not built)")
    apply_tp(model, group)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = SequenceParallelBlock(block, group, (i == 0), regather)
    ln = model.ln_f
    gathering = GatheringLayerNorm(ln.normalized_shape, eps=ln.eps, bias=ln.bias is not None)
    gathering.weight, gathering.bias = ln.weight, ln.bias    # the same Parameter objects
    gathering.group = group
    model.ln_f = gathering
    model.sp_group = group
    return model
