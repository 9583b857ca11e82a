"""Pure math for the book: memory, FLOPs, communication volume and time, pipeline bubbles.

No torch.distributed, no processes: calculators, widgets, worked answers and checkers all call
these functions, so an answer in the text can never disagree with a widget. One module per idea:

    labkit.costs.comm       alpha-beta time of collectives; algorithm vs bus bandwidth
    labkit.costs.hiding     when communication hides behind compute, per axis (DP, ZeRO-3,
                            TP, PP, CP): the crossover batch, width or sequence
    (more modules are added by later chapters: memory, pipeline, planner, ...)

Submodules load on first use: `from labkit import costs; costs.comm.ring_allreduce_time(...)`.
"""
import importlib


def __getattr__(name):
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as err:
        raise AttributeError(f"labkit.costs has no module {name!r}") from err
