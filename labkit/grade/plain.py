"""What crosses from the sandbox to the judge: plain data only, and the frames it travels in.

    plain(obj)            # exact types only; tensors on the CPU; labkit's dataclasses by field
    send(sock, obj)       # a frame: MAGIC, length, torch.save's bytes (read with weights_only)
    objects_in(args)      # the objects among a request's arguments, in a fixed order

Used on both sides: the sandbox (labkit.grade.child) writes with it, the judge
(labkit.grade.link) reads frames of the same shape and walks its arguments the same way. Imports
no torch until a message is written (the sandbox starts without it).
"""
from __future__ import annotations

import dataclasses
import io
import struct
import sys

MAGIC = b"LKSB"
HEADER = struct.Struct("<4sQ")
DEPTH = 12              # nesting of plain data at most


def send(sock, obj) -> None:
    import torch  # noqa: PLC0415 - torch is imported once a message goes back, not at start
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    sock.sendall(HEADER.pack(MAGIC, len(data)) + data)


def exactly(sock, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise EOFError("the judge closed the channel")
        out += chunk
    return bytes(out)


def tensor_from(data: bytes, parameter: bool, requires_grad: bool):
    """A tensor the judge sent (torch.save's bytes: every dtype, fp8 included)."""
    import torch  # noqa: PLC0415 - see send()
    t = torch.load(io.BytesIO(data), weights_only=True)
    if parameter:
        return torch.nn.Parameter(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad and t.is_floating_point() else t


SCALARS = (bool, int, float, str, complex, bytes, type(None))


def objects_in(obj, depth: int = 0):
    """The objects (not numbers, not strings) in a request's arguments, in a fixed order: the
    judge walks its own arguments the same way, so `{"__same__": i}` names one of them."""
    if type(obj) in SCALARS or depth > DEPTH:
        return
    if type(obj) in (list, tuple):
        for x in obj:
            yield from objects_in(x, depth + 1)
    elif type(obj) is dict:
        for x in obj.values():
            yield from objects_in(x, depth + 1)
    else:
        yield obj


def plain(obj, depth: int = 0, same: dict | None = None):
    """`obj` as data that runs no code when read: exact types only (a float subclass whose
    arithmetic lies is not a float here), tensors detached on the CPU; an object the judge sent
    in, returned as it came, as {"__same__": its place among the arguments}."""
    import torch  # noqa: PLC0415 - see send()
    t = type(obj)
    if t in SCALARS:
        return obj
    if same and id(obj) in same:
        return {"__same__": same[id(obj)]}
    if depth > DEPTH:
        return _opaque(obj, "nested too deeply")
    if t in (list, tuple):
        return t(plain(x, depth + 1, same) for x in obj)
    if t is dict:
        return {k if type(k) in (str, int, float, bool) else repr(k)[:80]:
                plain(v, depth + 1, same) for k, v in obj.items()}
    if t in (torch.Tensor, torch.nn.Parameter):
        return torch.Tensor(obj.detach().cpu()).clone() if t is torch.nn.Parameter \
            else obj.detach().cpu().clone()
    if t in (torch.dtype, torch.device):
        return obj
    if t is torch.Size:
        return tuple(int(x) for x in obj)
    if dataclasses.is_dataclass(obj) and _labkits(t):    # labkit's own records (an Action)
        return {"__labkit__": f"{t.__module__}:{t.__qualname__}",
                "fields": {f.name: plain(getattr(obj, f.name), depth + 1, same)
                           for f in dataclasses.fields(obj)}}
    if getattr(t, "__module__", "") == "numpy" and hasattr(obj, "item"):
        return plain(obj.item(), depth + 1)     # numpy's own scalar types (a subclass is not)
    return _opaque(obj)


def _labkits(t) -> bool:
    """A type of labkit's (not the student's, not a subclass of one: its exact module's)."""
    module = sys.modules.get(getattr(t, "__module__", ""))
    return (t.__module__.startswith("labkit.") and not t.__module__.startswith("labkit.check")
            and getattr(module, t.__qualname__, None) is t)


def _opaque(obj, why: str = "") -> dict:
    try:
        text = repr(obj)[:200]
    except BaseException:  # noqa: BLE001 - a repr that raises is still described
        text = f"<{type(obj).__name__} object>"
    return {"__opaque__": type(obj).__qualname__, "repr": text, "why": why}
