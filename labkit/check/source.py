"""The one reader of the reader's source: a function's code parsed with ast (read, never run, so
nothing in torch is patched), and what that code calls by name.

    tree_of(fn)               # ast of fn's dedented source, or None where it cannot be read
    calls_in(fn, names)       # ["all_reduce"]: the `x.name(...)` calls of fn's own source
    collectives_called(fn)    # the same for torch.distributed's collectives

A source read finds what the code says, not what it reaches at run time (a collective hidden in
a helper or behind getattr): the checkers pair it with a dispatch mode on the ranks
(labkit.observe.dispatch.CollectiveLog).
"""
from __future__ import annotations

import ast
import inspect
import textwrap

from labkit.check.answers import active, is_remote

# torch.distributed's collectives, as the reader writes them (send/recv/barrier are not)
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_tensor",
               "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "gather", "scatter", "all_to_all",
               "all_to_all_single")


def tree_of(fn) -> ast.AST | None:
    """fn's source, dedented and parsed; None for a builtin, a lambda typed at a prompt, or
    anything else inspect cannot find the source of. Under the grader, the source of a function
handed in is read in the sandbox and parsed here (text, never code)."""
    try:
        text = active().source(fn) if is_remote(fn) else inspect.getsource(fn)
        return ast.parse(textwrap.dedent(text)) if text else None
    except (OSError, TypeError, SyntaxError):
        return None


def calls_in(fn, names) -> list:
    """Sorted names among `names` that fn's own source calls as an attribute (`dist.name(...)`)."""
    tree = tree_of(fn)
    if tree is None:
        return []
    return sorted({n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                   and isinstance(n.func, ast.Attribute) and n.func.attr in names})


def collectives_called(fn) -> list:
    """torch.distributed collectives fn's own source calls; [] when it cannot be read."""
    return calls_in(fn, COLLECTIVES)
