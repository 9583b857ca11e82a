"""The reference GPT's memory measured beside labkit.costs.memory's and costs.activations' formulas.

    from labkit.calibrate import memory
    memory.states(cfg, "cpu")                           # parameters, gradients, AdamW state
    memory.activations(cfg, batch, "cpu", autocast=False)

Two counters the formulas do not feed. The bytes autograd saves for backward: PyTorch's
saved-tensor hooks (labkit.observe.saved.SavedTensors), each storage once, parameters left out,
per layer from an L-layer model less its 1-layer twin over L - 1 (labkit.activation_memory's
method), on the CPU and on a GPU alike. On a GPU also the CUDA allocator: bytes allocated after
the forward less before it, which adds what the hooks cannot see (the allocator's rounding, the
loss's own tensors). Model states: the storages' sizes after one AdamW step (on a GPU, the
allocator's count as the states appear).

Recipes. fp32: everything in fp32. Autocast: `torch.autocast(bf16)` around the forward (fp32
weights, gradients and Adam states, so 16 bytes per parameter as in fp32; bf16 matmul inputs,
fp32 norms, the bf16 copies of the weights it casts). Its activation formula is the autocast
recipe of labkit.costs.memory.plan where that exists; otherwise the fp32 formula is printed and
the row says so ("autocast recipe pending").
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch

from labkit.activation_memory import predicted_layer
from labkit.costs import memory as costs_memory
from labkit.costs import models
from labkit.model import GPT, get_batch, num_parameters, tiny_corpus
from labkit.observe.saved import SavedTensors

PENDING = "formula: fp32 (autocast recipe pending)"


def _sync_allocated(dev) -> int:
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    return torch.cuda.memory_allocated(dev)


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def states(cfg, device: str = "cpu") -> dict:
    """Bytes of parameters, gradients and AdamW state of GPT(cfg) after one step (fused AdamW on
    a GPU), measured and predicted (costs.memory.model_states, recipe fp32: 4 + 4 + 8 bytes)."""
    dev = torch.device(device)
    before = _sync_allocated(dev)
    model = GPT(cfg).to(dev)
    after_params = _sync_allocated(dev)
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), 1, cfg.block_size, step=0))
    model(x, y)[1].backward()
    after_grads = _sync_allocated(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    opt.step()
    after_opt = _sync_allocated(dev)
    params = list(model.parameters())
    opt_tensors = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    if dev.type == "cuda":     # the allocator: what the GPU really holds
        got = {"params": after_params - before, "grads": after_grads - after_params,
               "optimizer": after_opt - after_grads}
        how = "CUDA allocator"
    else:
        got = {"params": _storage_bytes(params),
               "grads": _storage_bytes([p.grad for p in params if p.grad is not None]),
               "optimizer": _storage_bytes(opt_tensors)}
        how = "storage sizes"
    n = num_parameters(model)
    want = costs_memory.model_states(n, recipe="fp32")
    return {"n_params": n, "how": how, "measured": got,
            "predicted": {"params": want.params, "grads": want.grads,
                          "optimizer": want.optimizer}}


def _autocast(dev, on: bool):
    return torch.autocast(dev.type, dtype=torch.bfloat16) if on else nullcontext()


def _saved(cfg, batch: int, dev, autocast: bool) -> dict:
    """Saved-tensor bytes of one forward of GPT(cfg) (and the allocator's delta on a GPU), the
    logits' share (the (B*T, V) storages the loss keeps), then backward to free it all."""
    x, y = (t.to(dev) for t in get_batch(tiny_corpus(), batch, cfg.block_size, step=0))
    model = GPT(cfg).to(dev)
    start = _sync_allocated(dev)
    with SavedTensors(exclude=model.parameters()) as saved, _autocast(dev, autocast):
        _, loss = model(x, y)
    held = _sync_allocated(dev) - start
    loss.backward()
    rows = batch * cfg.block_size
    logits = sum(b for shape, _, b in saved.tensors
                 if len(shape) >= 2 and shape[-1] == cfg.vocab_size
                 and shape[0] * (shape[1] if len(shape) == 3 else 1) == rows)
    out = {"saved": saved.bytes, "logits": logits,
           "allocator": held if dev.type == "cuda" else None}
    del model, loss, saved
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _predicted_autocast(spec, seq: int, batch: int):
    """(per layer, logits, how) from costs.memory.plan's autocast recipe, or None without one."""
    try:
        p = costs_memory.plan(spec, recipe="autocast", seq_len=seq, micro_batch=batch,
                              attention="flash")
    except (KeyError, TypeError, ValueError):
        return None
    parts = p.settings.get("activation_parts", {})
    if "per_layer" not in parts:
        return None
    return parts["per_layer"], parts.get("logits", 0.0), "formula: costs.memory autocast recipe"


def activations(cfg, batch: int, device: str = "cpu", autocast: bool = False) -> dict:
    """Activation bytes of GPT(cfg) on `batch` sequences, measured against the formula: one
    layer, all layers, the logits kept for the loss, what the formula leaves out (the final
    norm's and the head's inputs), and the whole model."""
    if cfg.n_layer < 2:
        raise ValueError(f"n_layer={cfg.n_layer}: need 2 or more layers to isolate one")
    dev = torch.device(device)
    whole = _saved(cfg, batch, dev, autocast)
    one = _saved(replace(cfg, n_layer=1), batch, dev, autocast)
    per_layer = (whole["saved"] - one["saved"]) / (cfg.n_layer - 1)
    spec = models.from_gpt_config(cfg)
    seq, L = cfg.block_size, cfg.n_layer
    # fp32 on the CPU and on a GPU: SDPA's fused kernel (a log-sum-exp per row, no scores)
    want_layer = sum(predicted_layer(cfg, batch).values())
    want_logits = costs_memory.activation_bytes(
        spec, seq_len=seq, micro_batch=batch, attention="flash", dtype_bytes=4)["logits"]
    how = "formula: fp32 (costs.activations, D = 4)"
    if autocast:
        found = _predicted_autocast(spec, seq, batch)
        if found is None:
            how = PENDING
        else:
            want_layer, want_logits, how = found
    outside = whole["saved"] - L * per_layer - whole["logits"]
    rows = [("one layer (saved-tensor hooks)", per_layer, want_layer),
            (f"{L} layers", L * per_layer, L * want_layer),
            ("logits kept for the loss", whole["logits"], want_logits),
            ("final norm and head inputs (no formula term)", outside, None),
            ("whole model (saved-tensor hooks)", whole["saved"], L * want_layer + want_logits)]
    if whole["allocator"] is not None:
        rows.append(("whole model (CUDA allocator)", whole["allocator"],
                     L * want_layer + want_logits))
    recipe = "autocast bf16" if autocast else "fp32"
    return {"recipe": recipe, "formula": how, "batch": batch, "seq": seq,
            "rows": [{"component": f"activations, {name}", "recipe": recipe, "measured": got,
                      "predicted": want, "ratio": got / want if want else None,
                      "formula": how if want is not None else "-"}
                     for name, got, want in rows]}


def state_rows(st: dict) -> list:
    """states() as rows: component, measured, predicted, ratio."""
    names = {"params": "parameters (fp32)", "grads": "gradients (fp32)",
             "optimizer": "AdamW momentum and variance (fp32)"}
    return [{"component": f"model states, {names[k]}", "recipe": "fp32 and autocast",
             "measured": st["measured"][k], "predicted": st["predicted"][k],
             "ratio": st["measured"][k] / st["predicted"][k],
             "formula": "costs.memory.model_states, recipe fp32"} for k in names]
