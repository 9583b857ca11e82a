"""The parallel degrees of a run, recorded and checked once: pure Python, so that the website's
calculators (Pyodide, no torch) hold the same record as the launched ranks.

    from labkit.degrees import Degrees
    d = Degrees(dp=2, tp=2, pp=2, zero=1)
    d.world                              # 8 = dp x tp x pp x cp
    d.problems(world=6)                  # every way it does not fit, each saying what to change
    d.check(world=8)                     # raises ValueError (or the error class given) if any

labkit.parallel.Plan (what a launched run does) and the planner's labkit.costs.plan_inputs.Config
(what a cluster-sized run would cost) are a Degrees with more fields after these (a subclass: the
degrees are declared once, here); labkit.topology.Topology (where each rank sits) holds one
beside its world size. All check it here: one list of rules, one wording, one spelling (`zero`
for the ZeRO stage, everywhere: the memory calculator, the widgets, the checkers), one field
order.

The field order is the order in which the book introduces the degrees (dp in chapter 02, tp 04,
pp 05, cp 07, ep 08), then zero, which is not a dimension of the rank grid but what the dp (x cp)
ranks do with the model states. It is not the order of the ranks: where each rank sits is
labkit.topology's (outermost first: pp, dp, cp, tp; Megatron-Core's initialize_model_parallel
names it innermost first, order="tp-cp-ep-dp-pp"). Degrees, Topology, Plan and Config take the
degrees in this one order and by keyword only, so a positional Config(8, 4, 8) fails at once
instead of reading tp=8 in one record and dp=8 in another.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

ZERO_STAGES = (0, 1, 2, 3)


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int) -> list:
    """Every (pp, dp, tp) with pp * dp * tp == world, in order of tp then pp."""
    return [(pp, world // (tp * pp), tp) for tp in divisors(world) for pp in divisors(world // tp)]


def zero_problem(zero) -> str:
    """What is wrong with `zero` as a ZeRO stage; '' when it is one (0, 1, 2 or 3)."""
    if zero in ZERO_STAGES:
        return ""
    return f"zero (the ZeRO stage) must be 0, 1, 2 or 3, got {zero!r}"


def check_zero(zero) -> None:
    """Raise ValueError unless `zero` is a ZeRO stage (the cost formulas' check)."""
    if zero_problem(zero):
        raise ValueError(zero_problem(zero))


@dataclass(frozen=True, kw_only=True)
class Degrees:
    dp: int = 1       # data-parallel replicas (ZeRO shards over them)
    tp: int = 1       # tensor-parallel shards of every layer
    pp: int = 1       # pipeline stages
    cp: int = 1       # context-parallel shards of the sequence
    ep: int = 1       # expert parallelism: experts over groups of ep consecutive dp ranks
    zero: int = 0     # ZeRO stage over dp (x cp): 0 (plain data parallelism), 1, 2, 3

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def degrees(self) -> Degrees:
        """The degrees alone: a Plan or a Config is a Degrees with more fields after them."""
        return Degrees(**{f.name: getattr(self, f.name) for f in fields(Degrees)})

    def problems(self, world: int | None = None, *, launch: bool = True) -> list:
        """Every way these degrees cannot describe a run (on `world` ranks, if given), each
        message naming the factors and a value that works; [] when they fit. launch=False (a
        cost model, whose searches try every stage on every dp): a ZeRO stage over one rank is
        allowed, and costs what stage 0 costs; a launched run refuses it as a mistake."""
        out = []
        for f in fields(Degrees):
            v = getattr(self, f.name)
            if f.name != "zero" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                out.append(f"{f.name} must be a positive integer, got {v!r}")
        if out:
            return out      # the rules below multiply and divide these
        if world is not None and self.world != world:
            out.append(self._world_problem(world))
        if zero_problem(self.zero):
            out.append(zero_problem(self.zero))
        elif self.zero and self.dp * self.cp == 1 and launch:
            # ZeRO shards over the data-parallel ranks and, with context parallelism, over dp x cp
            # (labkit.parallel.parallelize's dp_cp group; torchtitan's FSDP over dp_shard x cp)
            out.append(f"ZeRO stage {self.zero} shards over the data-parallel dimension, but "
                       f"dp=1: nothing to shard over. Use zero=0 or dp > 1.")
        if self.dp % self.ep:
            out.append(f"ep={self.ep} must divide dp={self.dp}: expert parallelism shards the "
                       f"experts over groups of ep data-parallel ranks; use an ep that divides "
                       f"{self.dp}")
        elif self.ep > 1 and self.zero == 3:
            out.append(f"ZeRO-3 with ep={self.ep}: ZeRO-3 would shard the experts over dp as "
                       f"well; use zero <= 2, or ep=1")
        return out

    def _world_problem(self, world: int) -> str:
        cp = self.cp > 1
        rest = world // self.cp if world % self.cp == 0 else world
        near = [f"pp={p} x dp={d} x tp={t}" + (f" x cp={self.cp}" if cp else "")
                for p, d, t in factorizations(rest)
                if t == self.tp or (p == self.pp and d * t == rest // p)][:4]
        names = "pp x dp x tp" + (" x cp" if cp else "")
        values = f"{self.pp} x {self.dp} x {self.tp}" + (f" x {self.cp}" if cp else "")
        return (f"{names} = {values} = {self.world}, but the world has {world} ranks: the "
                f"factors must multiply to {world}. "
                f"For example: {'; '.join(near) or f'pp=1 x dp={world} x tp=1'}.")

    def check(self, world: int | None = None, error=ValueError, *, launch: bool = True) -> None:
        """Raise `error` with every problem, in one message."""
        found = self.problems(world, launch=launch)
        if found:
            raise error("; ".join(found))
