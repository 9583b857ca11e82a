"""Checkpointing (chapter 06): save a run so that it can continue as if it had never stopped.

    labkit.checkpoint.rng        every generator's state (Python, NumPy, torch, CUDA)
    labkit.checkpoint.atomic     temp name, fsync, rename, `latest` last; checked loading
    labkit.checkpoint.full       full checkpoint: weights, optimizer, step, data, RNG per rank
    labkit.checkpoint.sharded    per-rank shards + one layout file; resharding N -> M on load
    labkit.checkpoint.async_save copy to CPU, write in a background thread (one in flight)
    labkit.checkpoint.errors     what can be wrong with a checkpoint, said clearly
    labkit.checkpoint.activation activation checkpointing: saved bytes and time, measured

Chapter 06's experiments live with its lab (labkit/labs/checkpoint/): resume (a tiny run that
uses every generator, the exact-resume lab), crash (SIGKILL a process mid-save and see what
survives), dcp_compare (the same state through torch.distributed.checkpoint, DCP).

Import the submodule you need (nothing runs at import).
"""
