"""Chapter 08's routing rule as plain loops, shared by 8.1 (the answer) and 8.2's reference."""
from __future__ import annotations


def kept_by_loops(expert, n_expert: int, cap) -> list:
    """Assignments kept: first choices of all tokens in token order, then second choices, ..."""
    n, k = len(expert), len(expert[0]) if expert else 0
    used, kept = [0] * n_expert, [[False] * k for _ in range(n)]
    for j in range(k):
        for t in range(n):
            e = expert[t][j]
            if cap is None or used[e] < cap:
                used[e] += 1
                kept[t][j] = True
    return kept
