"""What `labkit calibrate` prints (labkit.table, the one table printer) and the profile it writes.

    text(result)            # the tables, one per section
    profile(result)         # a dict: a chip profile (costs.chips.load_profile reads it) + the rows

The profile's roofs are the measured ones: the best matmul per dtype and the best of the read,
copy and add bandwidths; `datasheet` names the costs.chips entry of the same GPU where there is
one, so a reader sees both and their ratio.
"""
from __future__ import annotations

from labkit.calibrate import roofs
from labkit.costs import chips
from labkit.table import table


def _num(fmt: str):
    return lambda v: "-" if v is None else v if isinstance(v, str) else format(v, fmt)


def _mb(v):
    return "-" if v is None else f"{v / 1e6:,.3f}"


def roofs_text(res: dict) -> str:
    r, sheet = res["roofs"], res["datasheet"]
    vs = f"datasheet: {sheet.name}" if sheet else "datasheet: none for this device (a CPU)"
    out = [table(roofs.rows(r, sheet),
                 [("what", "what"), ("measured", "measured", _num(".4g")),
                  ("datasheet", "datasheet", _num(".4g")), ("measured / sheet", "ratio",
                                                             _num(".2f"))],
                 title=f"1. roofs of {res['device_name']} ({vs})")]
    if r["fp8"]:
        rate = r["fp8"]["rate"]
        out.append(f"   fp8 / bf16 at {rate['n']}^3: {rate['fp8_over_bf16']:.2f}x (datasheet: 2x)")
        out.append(table(r["fp8"]["accumulation"],
                         [("K", "k"), ("split accumulation", "split", ".2e"),
                          ("fast accumulation", "fast", ".2e")],
                         title="   fp8 GEMM relative error vs the exact product of the same fp8 "
                               "values (positive-mean data, M = N = 256)", indent="   "))
    else:
        out.append(f"   fp8: {r['fp8_why_not']}")
    return "\n".join(out)


def memory_text(res: dict) -> str:
    m = res["memory"]
    rows = m["states"] + [row for a in m["activations"] for row in a["rows"]]
    cfg = res["config"]
    return table(rows, [("component", "component"), ("recipe", "recipe"),
                        ("measured MB", "measured", _mb), ("predicted MB", "predicted", _mb),
                        ("ratio", "ratio", _num(".3f")), ("formula", "formula")],
                 title=f"2. memory of the reference GPT (h {cfg['n_embd']}, {cfg['n_layer']} "
                       f"layers, {cfg['n_head']} heads, seq {cfg['block_size']}, batch "
                       f"{m['batch']}), MB = 1e6 bytes; states by {m['states_how']}, "
                       f"activations by saved-tensor hooks"
                       + (" and the CUDA allocator" if res["cuda"] else ""))


def compute_text(res: dict) -> str:
    c, rc = res["compute"], res["recompute"]
    step = c["step"]
    rows = [{"what": "step time (ms)", "value": 1e3 * step["step_s"]},
            {"what": "tokens / s", "value": step["tokens_per_s"]},
            {"what": f"MFU vs the measured {c['dtype']} roof", "value": c["mfu_measured"]},
            {"what": "MFU vs the datasheet", "value": c["mfu_datasheet"]},
            {"what": "recomputation: measured factor (every block)",
             "value": rc["measured_factor"]},
            {"what": "recomputation: (f + b + f)/(f + b), measured f and b",
             "value": rc["predicted_factor"]},
            {"what": "recomputation: torch's FLOP count, recompute / plain",
             "value": rc["flops_factor"]}]
    for r in rows:
        if r["value"] is None:
            r["value"] = "n.a.: no datasheet for this device"
    return table(rows, [("what", "what"), ("value", "value", _num(",.4g"), ">")],
                 title=f"3. compute: one training step of the reference GPT, {step['recipe']}, "
                       f"batch {step['batch']} x {step['seq']} tokens (median of "
                       f"{len(step['steps'])}); model FLOPs 6N + 12 L h s per token; "
                       f"recomputation in fp32, batch {rc['batch']}")


def comm_text(res: dict) -> str:
    c = res["comm"]
    if c is None or "skipped" in c:
        return f"4. communication: not measured ({(c or {}).get('skipped', 'no ranks')})"
    head = (f"4. all-reduce on {c['ranks']} ranks, backend {c['backend']}, device {c['device']}; "
            + (f"alpha-beta fit (costs.comm.fit_alpha_beta): alpha {c['alpha'] * 1e6:.1f} µs per "
               f"message, bandwidth {c['bandwidth'] / 1e9:.3g} GB/s" if c["alpha"] is not None
               else f"no alpha-beta fit: {c['fit_error']}"))
    return table(c["rows"], [("bytes", "bytes", ","), ("median ms", "seconds", lambda v:
                                                        f"{v * 1e3:.3f}"),
                             ("busbw GB/s", "busbw", lambda v: f"{v / 1e9:.3g}"),
                             ("model ms", "model_seconds", lambda v: f"{v * 1e3:.3f}"),
                             ("measured / model", "ratio", ".2f")], title=head)


def text(res: dict) -> str:
    return "\n\n".join([roofs_text(res), memory_text(res), compute_text(res), comm_text(res)])


def chip_of(res: dict) -> chips.Chip:
    """The measured Chip: the measured roofs, this device's capacity, provenance."""
    r, sheet = res["roofs"], res["datasheet"]
    return chips.Chip(f"{res['device_name']} (measured)", dict(r["peak_flops"]), r["bandwidth"],
                      f"measured by labkit calibrate on {res['provenance']['date']}",
                      res["capacity"], sheet.name if sheet else None, dict(res["provenance"]))


def profile(res: dict) -> dict:
    """The JSON: a chip profile (costs.chips.profile_dict) with every section's rows."""
    comp = dict(res["compute"], datasheet=None)
    return chips.profile_dict(
        chip_of(res), device=res["device"], quick=res["quick"], config=res["config"],
        roofs=res["roofs"], memory=res["memory"], compute=comp, recompute=res["recompute"],
        comm=res["comm"], seconds=res["seconds"])
