"""Benchmarks: `labkit bench [NAME ...]`. One module per topic with `main(argv) -> dict`.

Each prints a table and returns {"rows": [...], ...}; timings are ratios against the built-in
or peer measured in the same run.

Each also has `options(argv) -> (options, the arguments it does not take)`: labkit.cli calls it
for every named benchmark before any runs, so that a bad value is one line before minutes of
measuring (parsers from labkit.cliargs.bench_parser)."""
