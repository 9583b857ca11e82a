"""Mixture of experts and expert parallelism (chapter 08).

    from labkit.model import GPT, GPTConfig
    model = GPT(GPTConfig(n_expert=8, expert_top_k=2, capacity_factor=1.25))

Modules, one idea each:
    router           gates (softmax, sigmoid), top-k, capacity and dropping, the Switch loss,
                     DeepSeek-V3's loss-free bias
    layer            MoE: the one-process layer (the reference)
    expert_parallel  experts sharded over an ep group; tokens moved by all-to-all
    alltoall         all-to-all from point-to-point sends (naive and pairwise schedules)

Timing the schedules on real ranks is an experiment: labkit/labs/moe/alltoall.py.
"""
