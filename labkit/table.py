"""One way to print a table of results: labs, benchmarks, the grader and the CLI all use it.

    from labkit.table import table
    print(table(rows, [("ranks", "ranks"),                      # header, dict key
                       ("time ms", lambda r: 1e3 * r["seconds"], ".2f"),  # computed, formatted
                       ("vs torch", "ratio", lambda v: f"{v:.2f}x")],
                title="all-reduce, 4 MiB"))

A column is `header` (the dict key, or the position in a tuple row), `(header, key)`,
`(header, key, fmt)` or `(header, key, fmt, align)`: key is a dict key, a tuple index or a
function of the row; fmt is a format spec (".3f", ",") or a function of the value; align is "<"
or ">" (default: numbers right, everything else left). None prints as an empty cell. Columns
are two spaces apart; lines carry no trailing spaces.
"""
from __future__ import annotations

from numbers import Number


def _spec(col, i):
    if isinstance(col, str):
        col = (col,)
    header, key, fmt, align = (tuple(col) + (None, None, None))[:4]
    return str(header), (header if key is None else key), fmt, align, i


def _value(row, key, i):
    if callable(key):
        return key(row)
    if isinstance(row, dict):
        return row.get(key)
    return row[key if isinstance(key, int) else i]


def _cell(value, fmt) -> str:
    if value is None:
        return ""
    if callable(fmt):
        return str(fmt(value))
    if fmt:
        return format(value, fmt)
    return str(value)


def _numeric(column) -> bool:
    present = [v for v in column if v is not None]
    return bool(present) and all(isinstance(v, Number) and not isinstance(v, bool) for v in present)


def table(rows, columns, *, title: str | None = None, indent: str = "", rule: bool = True) -> str:
    """The rows as aligned text under a header (and a rule); `title` goes on the first line."""
    specs = [_spec(c, i) for i, c in enumerate(columns)]
    values = [[_value(r, key, i) for _, key, _, _, i in specs] for r in rows]
    cells = [[_cell(v, s[2]) for v, s in zip(vals, specs)] for vals in values]
    heads = [s[0] for s in specs]
    widths = [max([len(h)] + [len(row[j]) for row in cells]) for j, h in enumerate(heads)]
    right = [s[3] == ">" if s[3] else _numeric([vals[j] for vals in values])
             for j, s in enumerate(specs)]

    def line(texts):
        parts = [t.rjust(w) if r else t.ljust(w) for t, w, r in zip(texts, widths, right)]
        return (indent + "  ".join(parts)).rstrip()

    out = [title] if title else []
    out.append(line(heads))
    if rule:
        out.append(indent + "  ".join("-" * w for w in widths))
    out += [line(c) for c in cells]
    return "\n".join(out)
