"""Look a thing up by name in a table, with an error that lists the names: the one way
labkit.costs resolves a GPU, a chip or a precision recipe given by name or as an object."""
from __future__ import annotations


def lookup(table: dict, key, kind: str, or_else: str, given: type | None = None):
    """table[key]; `key` itself when it is already a `given` (the object, not its name). An
    unknown name raises a KeyError that lists the names and says what else may be passed."""
    if given is not None and isinstance(key, given):
        return key
    if key not in table:
        raise KeyError(f"unknown {kind} {key!r}; choose one of {', '.join(table)} or {or_else}")
    return table[key]
