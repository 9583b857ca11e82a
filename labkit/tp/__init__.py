"""Tensor parallelism, Megatron style (Shoeybi et al., "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", 2019, arXiv:1909.08053).

    from labkit.observe import commlog
    from labkit.tp import apply_tp, gather_tp_state
    model = apply_tp(GPT(cfg, seed=0), group)   # every rank: the same model, its own shard
    with commlog.record() as log:
        logits, loss = model(x, y); loss.backward()
    log.bytes("all_reduce")                      # 4 * n_layer all-reduces of b*s*h elements

    labkit run tp --nproc 2                      # the chapter's lab from a terminal

Modules, one idea each:
    operators   Megatron's conjugate operators f and g (and the gather/split pair)
    layers      ColumnParallelLinear, RowParallelLinear
    blocks      TensorParallelMLP (column then row; NaiveTensorParallelMLP beside it),
                TensorParallelAttention (heads split)
    gpt         apply_tp(model, group): the one-process GPT turned into its TP version; gather back
    collective_matmul  the all-gather before a column-parallel matmul hidden ring step by step
                (Wang et al. 2023; PyTorch's async TP)

The experiments (rank jobs that count bytes and time layers, the crossover sweep, the collective
matmul's timing) live with the lab: labkit.labs.tp.
"""
from labkit.tp.blocks import NaiveTensorParallelMLP, TensorParallelAttention, TensorParallelMLP
from labkit.tp.gpt import apply_tp, check_tp_sizes, gather_tp_grads, gather_tp_state
from labkit.tp.layers import ColumnParallelLinear, RowParallelLinear
from labkit.tp.operators import f, g, gather_last_dim, split_last_dim

__all__ = ["f", "g", "gather_last_dim", "split_last_dim", "ColumnParallelLinear",
           "RowParallelLinear", "NaiveTensorParallelMLP", "TensorParallelAttention",
           "TensorParallelMLP", "apply_tp",
           "check_tp_sizes", "gather_tp_grads", "gather_tp_state"]
