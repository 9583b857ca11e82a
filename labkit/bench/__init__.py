"""Benchmarks: `labkit bench [NAME ...]`. One module per topic with `main(argv) -> dict`.

Each prints a table and returns {"rows": [...], ...}; timings are ratios against the built-in
or peer measured in the same run."""
