"""Checkers for chapter 06 (checkpointing and fault tolerance). One module per exercise:

    resume        6.1  labkit.check.ch06.exact_resume(capture_rng_state, restore_rng_state)
    sharded_save  6.2  labkit.check.ch06.resharding(save_sharded, load_resharded)
    on_disk       6.3  labkit.check.ch06.checkpoint_size(predict_checkpoint_bytes)

The ranks of 6.2 import this package: none of its modules imports labkit.checkpoint at its top,
so a reader's import of it on a rank is seen (labkit.check.refusal.Forbidden.imports_watched).
"""
from __future__ import annotations

from labkit.check.ch06 import on_disk, resume, sharded_save
from labkit.check.ch06.on_disk import checkpoint_size, costs_prediction, size_model_params
from labkit.check.ch06.resume import (
                                      assert_resume_matches,
                                      assert_round_trip,
                                      assert_weights_only,
                                      exact_resume,
)
from labkit.check.ch06.sharded_save import FORBIDDEN, resharding, split_range

EXERCISES = {m.EXERCISE: (m.TITLE, m.POINTS) for m in (resume, sharded_save, on_disk)}
__all__ = ["EXERCISES", "FORBIDDEN", "assert_resume_matches", "assert_round_trip",
           "assert_weights_only", "checkpoint_size", "costs_prediction", "exact_resume",
           "resharding", "size_model_params", "split_range"]
