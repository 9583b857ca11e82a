"""Mistake tables as data: the known wrong answers of a prediction, as the ratio of the answer
to the right one, each with the hint that names the mistake.

    MISTAKES = [(0.5, "About half: f and g each communicate once per pass; count both passes."),
                (2.0, "Twice: count only what this rank sends.")]
    fail(said + diagnose(got / right, MISTAKES, default="How many all-reduces per layer?"))
"""
from __future__ import annotations


def diagnose(ratio: float, mistakes, default: str, tolerance: float = 0.05) -> str:
    """The hint of the first mistake whose ratio is within `tolerance` (relative) of `ratio`;
    `default` where none is."""
    for wrong, hint in mistakes:
        if abs(ratio - wrong) <= tolerance * abs(wrong):
            return hint
    return default
