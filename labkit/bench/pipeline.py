"""Benchmark: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-H2, ZB-V: measured vs simulated vs formula.

    labkit bench pipeline [--stages 2 4] [--K 4 8 16] [--v 2] [--pad-ms 5 10] [--repeats 3]
    labkit bench pipeline --back-to-back --stages 4 --K 8 [--steps 4] [--pad-ms 8 16]

For each P, one launch runs every schedule at every K (median of `repeats` steps). Reported per
schedule: measured step time; its ratio to GPipe's in the same run; the simulator's step time
predicted from the measured per-action times and message latency (measured / predicted = the
executor's overhead); measured bubble (median over repeats) next to the formula; activations held on
stage 0; whether every repeat was causal and above its floor (labkit.pipeline.causality). Two modes:
'pad' (stand-in compute slept per action, as if each stage had its own accelerator) and 'compute'
(the real tiny GPT only, P processes sharing the machine's cores).

--back-to-back: instead, steps with a flush against steps back to back (optimizer
post-validation; labkit.labs.pipeline.back_to_back) for 1F1B, interleaved 1F1B, ZB-H1, ZB-H2 and
ZB-V, padded: the period and bubble read off the timeline both ways, beside the simulator from the
run's own action times and the formula, and the bubble each schedule sheds without the flush.
"""
from __future__ import annotations

from labkit.cliargs import BadOption, bench_parser, count
from labkit.labs.pipeline import back_to_back, measure
from labkit.pipeline import schedules


def options(argv=()):
    """(options, the arguments not taken), checked before any benchmark runs (labkit.bench)."""
    p = bench_parser("pipeline", repeats=3)
    p.add_argument("--stages", type=count, nargs="+", default=[2, 4],
                   help="pipeline stages P to measure")
    p.add_argument("--K", type=count, nargs="+", default=[4, 8, 16],
                   help="micro-batches per step to measure")
    p.add_argument("--v", type=count, default=2, help="chunks per stage (interleaved)")
    p.add_argument("--pad-ms", type=float, nargs=2, default=None,
                   help="ms slept per forward and backward "
                        "(default 5 10; 8 16 with --back-to-back)")
    p.add_argument("--modes", nargs="+", default=["pad", "compute"], choices=["pad", "compute"],
                   help="pad: sleeps stand in for each stage's compute; compute: real compute only")
    p.add_argument("--back-to-back", action="store_true",
                   help="steps with a flush vs back to back (no flush), padded")
    p.add_argument("--steps", type=count, default=4, help="steps per run with --back-to-back")
    args, rest = p.parse_known_args(list(argv or ()))
    if args.pad_ms is not None and min(args.pad_ms) < 0:
        raise BadOption(f"--pad-ms {' '.join(f'{x:g}' for x in args.pad_ms)}: sleeps cannot be "
                        f"negative; e.g. --pad-ms 5 10, or 0 0 for real compute only")
    for P in args.stages:
        if P < 2:
            raise BadOption(f"--stages {P}: a pipeline needs 2 stages or more; e.g. --stages 2 4")
        for sched, K, v in _specs(P, args.K, args.v, gpipe=not args.back_to_back):
            try:
                schedules.make(sched, P, K, v)
            except ValueError as err:
                raise BadOption(f"--stages {P} --K {K}: {sched}: {err}") from None
    return args, rest


def main(argv=()) -> dict:
    args, _ = options(argv)
    if args.back_to_back:
        args.pad_ms = args.pad_ms or [8.0, 16.0]
        return _back_to_back(args)
    args.pad_ms = args.pad_ms or [5.0, 10.0]
    rows = []
    for mode in args.modes:
        pad = (args.pad_ms[0] / 1e3, args.pad_ms[1] / 1e3) if mode == "pad" else None
        for P in args.stages:
            got = measure.measure(P, _specs(P, args.K, args.v, gpipe=True), pad=pad,
                                  repeats=args.repeats)
            gpipe = {r["K"]: r["step_s"] for r in got if r["schedule"] == "gpipe"}
            for r in got:
                r.pop("timeline")
                r.pop("timelines")
                r["mode"] = mode
                r["ratio_to_gpipe"] = r["step_s"] / gpipe[r["K"]]
                r["measured_over_predicted"] = r["overhead"]      # Measured.ratio
            print(f"mode={mode}" + (f" (pad {args.pad_ms[0]:g}/{args.pad_ms[1]:g} ms per F/B)"
                                    if pad else " (real compute only)"), flush=True)
            print(measure.table(got), flush=True)
            bad = [m for r in got for m in r["violations"]]
            print("   causality and floor checks (labkit.pipeline.causality): "
                  + ("held in every repeat" if not bad else f"{len(bad)} violations: {bad[0]}"),
                  flush=True)
            for K in args.K:
                print(f"   K={K}: step time vs GPipe in the same run: " + ", ".join(
                    f"{r['schedule']} {r['ratio_to_gpipe']:.2f}x" for r in got
                    if r["K"] == K and r["schedule"] != "gpipe"), flush=True)
            rows += got
    return {"rows": rows, "units": {"step_s": "s", "predicted_step_s": "s", "t_p2p_s": "s",
                                    "peak_bytes": "bytes", "bubble": "fraction of P x step"}}


def _specs(P: int, Ks, v: int, gpipe: bool) -> list:
    """(schedule, K, v) for every schedule at each K: interleaved only where it accepts K;
    ZB-V has 2 chunks per stage in a V (n_layer >= 2P: measure's models have enough)."""
    specs = []
    for K in Ks:
        specs += ([("gpipe", K, 1)] if gpipe else []) + [("1f1b", K, 1)]
        try:
            schedules.make("interleaved", P, K, v)
            specs.append(("interleaved", K, v))
        except ValueError:
            pass
        specs += [("zb-h1", K, 1), ("zb-h2", K, 1), ("zb-v", K, 2)]
    return specs


def _back_to_back(args) -> dict:
    pad = (args.pad_ms[0] / 1e3, args.pad_ms[1] / 1e3)
    rows = []
    for P in args.stages:
        got = back_to_back.measure(P, _specs(P, args.K, args.v, gpipe=False), steps=args.steps,
                                   pad=pad, repeats=args.repeats)
        for r in got:
            r.pop("timeline_flush")
            r.pop("timeline_b2b")
            r["shed"] = r["bubble_flush"] - r["bubble_b2b"]
            r["sim_shed"] = r["sim_bubble_flush"] - r["sim_bubble_b2b"]
        print(f"P={P}, {args.steps} steps per run, pad {args.pad_ms[0]:g}/{args.pad_ms[1]:g} ms "
              f"per F/B, medians of {args.repeats} repeats", flush=True)
        print(back_to_back.table(got), flush=True)
        print("   bubble shed without the flush, measured (simulated): " + ", ".join(
            f"{r['schedule']} K={r['K']} {r['shed']:+.1%} ({r['sim_shed']:+.1%})" for r in got),
            flush=True)
        gaps = [r[f"bubble_{w}"] - r[f"sim_bubble_{w}"] for r in got for w in ("flush", "b2b")]
        stretch = sorted(r[f"stretch_{w}"] for r in got for w in ("flush", "b2b")
                         if r[f"stretch_{w}"] is not None)
        print(f"   measured minus simulated bubble: {min(gaps):+.1%} .. {max(gaps):+.1%} (the "
              f"executor between actions)" + (f"; actions took {stretch[0]:.2f}x .. "
                                              f"{stretch[-1]:.2f}x their pads (load on the "
                                              f"machine, real compute)" if stretch else ""),
              flush=True)
        print(f"   back-to-back runs equal the one-process reference (largest gradient error "
              f"{max(r['max_grad_error'] for r in got):.1e}); causality: "
              + ("held in every run" if not any(r["violations"] for r in got)
                 else f"{sum(len(r['violations']) for r in got)} violations"), flush=True)
        rows += got
    return {"rows": rows, "units": {"period_flush_s": "s", "period_b2b_s": "s",
                                    "between_flush_s": "s",
                                    "bubble_flush": "fraction of P x period",
                                    "bubble_b2b": "fraction of P x period"}}
