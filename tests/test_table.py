"""labkit.table: one formatter for every printed table."""
from labkit.table import table


def test_dict_rows_keys_functions_formats_and_alignment():
    rows = [{"ranks": 2, "kind": "ring", "s": 0.00123, "ratio": 1.5},
            {"ranks": 16, "kind": "parameter_server", "s": 0.5, "ratio": None}]
    out = table(rows, [("ranks", "ranks"), ("kind", "kind"), ("ms", lambda r: 1e3 * r["s"], ".2f"),
                       ("vs", "ratio", lambda v: f"{v:.1f}x", ">")], title="demo")
    assert out.splitlines() == [
        "demo",
        "ranks  kind                  ms    vs",
        "-----  ----------------  ------  ----",
        "    2  ring                1.23  1.5x",
        "   16  parameter_server  500.00",     # None: an empty cell, no trailing spaces
    ]


def test_tuple_rows_plain_headers_indent_and_no_rule():
    out = table([("00", "Why distribute?", "intro"),
                 ("06", "Checkpointing", "checkpoint, train_ft")],
                ["ch", "chapter", "labs"], indent="  ", rule=False)
    assert out.splitlines() == ["  ch  chapter          labs",
                                "  00  Why distribute?  intro",
                                "  06  Checkpointing    checkpoint, train_ft"]


def test_bools_are_text_and_empty_tables_have_a_header():
    assert table([{"ok": True}], ["ok"]).splitlines()[-1] == "True"
    assert table([], [("a", "a"), ("b", "b")]).splitlines() == ["a  b", "-  -"]
