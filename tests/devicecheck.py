"""Device mistakes caught on a CPU-only machine (shared by the tests of the GPU-ready labs).

On a GPU rank every tensor must be made on labkit.launch.device(): a `torch.zeros(n)` without
`device=` lands on the CPU, and NCCL or the next op with a CUDA tensor fails, but only there.
Two ways to see such a call here, where every device is the CPU:

- `default_device("meta")`: torch's default device becomes "meta" while the rank computes on the
  CPU. A tensor made without `device=` is then a meta tensor; the first op that mixes it with a
  CPU tensor raises, or a result comes back on meta. (The GPU case exactly: the default is
  elsewhere than where the rank computes.) For code that builds nothing itself.
- `ImplicitDevice(files)`: a torch function mode that records every factory call (torch.empty,
  zeros, ones, full, rand*, arange, tensor, ...) made *from the given labkit files* without a
  `device=` argument. For whole rank functions that also build models and batches on the CPU
  on purpose (those calls are in labkit/model.py, or say device="cpu").
"""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def default_device(name: str = "meta"):
    import torch

    torch.set_default_device(name)
    try:
        yield
    finally:
        torch.set_default_device(None)


def _factories():
    import torch

    names = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor",
             "as_tensor", "eye", "linspace", "empty_strided", "scalar_tensor")
    return {getattr(torch, n) for n in names}


def ImplicitDevice(files):
    """A TorchFunctionMode recording (file, line, function) of factory calls without device=,
    made directly from a file whose path ends with one of `files`."""
    from torch.overrides import TorchFunctionMode

    factories = _factories()

    class _Mode(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in factories and kwargs.get("device") is None:
                frame = sys._getframe(1)
                path = frame.f_code.co_filename.replace("\\", "/")
                if any(path.endswith(f) for f in files):
                    self.calls.append((path.rsplit("labkit/", 1)[-1], frame.f_lineno,
                                       f"torch.{func.__name__}"))
            return func(*args, **kwargs)

    return _Mode()


RANK_SIDE = ("labkit/collectives.py", "labkit/bench/collectives.py", "labkit/tp/operators.py",
             "labkit/tp/layers.py", "labkit/tp/blocks.py", "labkit/tp/gpt.py",
             "labkit/tp/measure.py", "labkit/pipeline/executor.py", "labkit/pipeline/measure.py",
             "labkit/labs/hybrid.py")
