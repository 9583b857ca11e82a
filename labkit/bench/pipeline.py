"""Benchmark: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V: measured vs simulated vs formula.

    labkit bench pipeline [--stages 2 4] [--K 4 8 16] [--v 2] [--pad-ms 5 10] [--repeats 3]

For each P, one launch runs every schedule at every K (median of `repeats` steps). Reported per schedule:
measured step time; its ratio to GPipe's in the same run; the simulator's step time predicted
from the measured per-action times and message latency (measured / predicted = the executor's
overhead); measured bubble (median over repeats) next to the formula; activations held on stage 0; whether
every repeat was causal and above its floor (labkit.pipeline.causality). Two modes: 'pad'
(stand-in compute slept per action, as if each stage had its own accelerator) and 'compute'
(the real tiny GPT only, P processes sharing the machine's cores).
"""
from __future__ import annotations

import argparse

from labkit.pipeline import measure, schedules


def main(argv=()) -> dict:
    p = argparse.ArgumentParser(prog="labkit bench pipeline")
    p.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    p.add_argument("--K", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--v", type=int, default=2)
    p.add_argument("--pad-ms", type=float, nargs=2, default=[5.0, 10.0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["pad", "compute"], choices=["pad", "compute"])
    args = p.parse_args(list(argv))
    rows = []
    for mode in args.modes:
        pad = (args.pad_ms[0] / 1e3, args.pad_ms[1] / 1e3) if mode == "pad" else None
        for P in args.stages:
            specs = []
            for K in args.K:
                specs += [("gpipe", K, 1), ("1f1b", K, 1)]
                try:
                    schedules.make("interleaved", P, K, args.v)
                    specs.append(("interleaved", K, args.v))
                except ValueError:
                    pass
                # ZB-V: 2 chunks per stage in a V (needs n_layer >= 2P: measure's model has 8)
                specs += [("zb-h1", K, 1), ("zb-h2", K, 1), ("zb-v", K, 2)]
            got = measure.measure(P, specs, pad=pad, repeats=args.repeats)
            gpipe = {r["K"]: r["step_s"] for r in got if r["schedule"] == "gpipe"}
            for r in got:
                r.pop("timeline")
                r.pop("timelines")
                r["mode"] = mode
                r["ratio_to_gpipe"] = r["step_s"] / gpipe[r["K"]]
                r["measured_over_predicted"] = r["step_s"] / r["predicted_step_s"]
            print(f"mode={mode}" + (f" (pad {args.pad_ms[0]:g}/{args.pad_ms[1]:g} ms per F/B)"
                                    if pad else " (real compute only)"), flush=True)
            print(measure.table(got), flush=True)
            bad = [m for r in got for m in r["violations"]]
            print(f"   causality and floor checks (labkit.pipeline.causality): "
                  + ("held in every repeat" if not bad else f"{len(bad)} violations: {bad[0]}"),
                  flush=True)
            for K in args.K:
                print(f"   K={K}: step time vs GPipe in the same run: " + ", ".join(
                    f"{r['schedule']} {r['ratio_to_gpipe']:.2f}x" for r in got
                    if r["K"] == K and r["schedule"] != "gpipe"), flush=True)
            rows += got
    return {"rows": rows, "units": {"step_s": "s", "predicted_step_s": "s", "t_p2p_s": "s",
                                    "peak_bytes": "bytes", "bubble": "fraction of P x step"}}
