"""Chapter 10's experiments: the rank-side training run of a parallel plan (`job.train`, which
the hybrid, context and moe labs, chapter 10's checker, the tests and `labkit bench parallel`
share) and its comparison with the one-process reference and with labkit.costs
(`compare`). The algorithm they run is labkit.parallel's; the lab is labkit/labs/hybrid.py.
This package is no lab itself (it has no `main`): `labkit list` does not show it.
"""
