"""Pipeline schedules as data, and the three without a split backward (labkit.pipeline.schedules
is the door to all of them; its docstring explains the notation).

    Action(kind, mb, chunk)     F, B or W of micro-batch mb on local chunk `chunk`
    Schedule(name, P, K, v, stages, placement)    per stage, the ordered list of its actions
    gpipe(P, K), one_f_one_b(P, K), interleaved_1f1b(P, K, v), from_stage_fn(fn, P, K)

GPipe (Huang et al., 2019, arXiv:1811.06965); 1F1B (PipeDream-Flush; Narayanan et al., 2021,
arXiv:2006.09503); interleaved 1F1B (Narayanan et al., SC'21, arXiv:2104.04473).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Action:
    kind: str       # "F" forward, "B" backward (input gradient only when the schedule has W), "W"
    mb: int         # micro-batch index, 0 .. K-1
    chunk: int = 0  # local model chunk on this stage, 0 .. v-1

    def __repr__(self):
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def F(mb: int, chunk: int = 0) -> Action:
    """Forward of micro-batch `mb` (on local chunk `chunk`)."""
    return Action("F", mb, chunk)


def B(mb: int, chunk: int = 0) -> Action:
    """Backward of micro-batch `mb` (on local chunk `chunk`). In a schedule that also has W
    actions, B computes only the gradient with respect to the stage's input (what the stage
    before waits for) and W the weight gradients."""
    return Action("B", mb, chunk)


def W(mb: int, chunk: int = 0) -> Action:
    """Weight-gradient half of micro-batch `mb`'s backward: no message, deferrable."""
    return Action("W", mb, chunk)


@dataclass
class Schedule:
    name: str
    P: int                      # stages (processes)
    K: int                      # micro-batches per step
    v: int = 1                  # model chunks per stage
    stages: list = field(default_factory=list)  # stages[p] = [Action, ...] in run order
    placement: tuple = None     # placement[g] = stage of global chunk g; None: g % P (round robin)

    @property
    def split(self) -> bool:
        """True when the backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for actions in self.stages for a in actions)

    @property
    def n_chunks(self) -> int:
        return self.P * self.v

    def chunks_of(self, stage: int) -> list:
        """The global chunks `stage` holds, in local order (local chunk j = chunks_of(stage)[j])."""
        if self.placement is None:
            return [j * self.P + stage for j in range(self.v)]
        return [g for g, p in enumerate(self.placement) if p == stage]

    def global_chunk(self, stage: int, chunk: int) -> int:
        if self.placement is None:
            return chunk * self.P + stage
        return self.chunks_of(stage)[chunk]

    def stage_of(self, global_chunk: int) -> int:
        if self.placement is None:
            return global_chunk % self.P
        return self.placement[global_chunk]

    def local_chunk(self, global_chunk: int) -> int:
        """The local index of `global_chunk` on the stage that holds it."""
        if self.placement is None:
            return global_chunk // self.P
        return self.chunks_of(self.stage_of(global_chunk)).index(global_chunk)

    def __repr__(self):
        rows = "\n".join(f"  stage {p}: {' '.join(map(repr, a))}"
                         for p, a in enumerate(self.stages))
        where = "" if self.placement is None else f", placement={list(self.placement)}"
        return f"Schedule({self.name}, P={self.P}, K={self.K}, v={self.v}{where})\n{rows}"


def v_placement(P: int) -> tuple:
    """ZB-V's placement of 2P chunks on P stages: stage r holds chunks r and 2P-1-r, so the
    forward goes down the stages and comes back up (the loss is on stage 0)."""
    return tuple(g if g < P else 2 * P - 1 - g for g in range(2 * P))


def check_sizes(P, K, v=1):
    for name, val in (("P", P), ("K", K), ("v", v)):
        if int(val) != val or val < 1:
            raise ValueError(f"{name}={val}: need a whole number >= 1")


def gpipe(P: int, K: int) -> Schedule:
    """GPipe: every stage runs F0..F(K-1), then B(K-1)..B0 (newest activations first)."""
    check_sizes(P, K)
    stage = [F(k) for k in range(K)] + [B(k) for k in reversed(range(K))]
    return Schedule("gpipe", P, K, 1, [list(stage) for _ in range(P)])


def one_f_one_b_stage(p: int, P: int, K: int) -> list:
    """The 1F1B order for stage p: warm-up forwards, steady F/B pairs, cool-down backwards."""
    warmup = min(P - p - 1, K)           # forwards in flight before the first backward arrives
    order = [F(k) for k in range(warmup)]
    for i in range(K - warmup):          # steady state: one forward, then the oldest backward
        order += [F(warmup + i), B(i)]
    order += [B(k) for k in range(K - warmup, K)]  # cool-down: drain the rest
    return order


def one_f_one_b(P: int, K: int) -> Schedule:
    """1F1B (PipeDream-Flush): same bubble as GPipe, at most P - p micro-batches held on stage p."""
    check_sizes(P, K)
    return Schedule("1f1b", P, K, 1, [one_f_one_b_stage(p, P, K) for p in range(P)])


def interleaved_1f1b(P: int, K: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B with v chunks per stage (Megatron-LM's order, as PyTorch's
    ScheduleInterleaved1F1B generalises it to K not a multiple of P).

    Units are (micro-batch, chunk) pairs taken in rounds of m micro-batches: forward unit i is
    chunk (i // m) % v of micro-batch (i // (m v)) m + i % m; backward units walk the chunks in
    reverse. Stage p runs 2(P - p - 1) + (v - 1) m warm-up units, then alternates. m = P when
    P divides K (Megatron's case); otherwise the K micro-batches are cut into r = max(1, K // P)
    rounds of m = K / r (K < 2P: one round of all K), which needs r to divide K."""
    check_sizes(P, K, v)
    rounds = max(1, K // P)
    if K % rounds:
        ok = [k for k in range(K - P, K + P + 1) if k >= 1 and k % max(1, k // P) == 0]
        raise ValueError(f"interleaved 1F1B (P={P}, v={v}) cuts K={K} micro-batches into "
                         f"K // P = {rounds} rounds of equal size, and {rounds} does not divide "
                         f"{K}; nearby K that work: {ok[:6]}")
    m = K // rounds
    total = v * K

    def unit(i, backward):
        chunk = (i // m) % v
        return Action("B" if backward else "F", (i // (m * v)) * m + i % m,
                      v - 1 - chunk if backward else chunk)

    stages = []
    for p in range(P):
        warmup = min(total, 2 * (P - p - 1) + (v - 1) * m)
        order = [unit(i, False) for i in range(warmup)]
        for i in range(total - warmup):
            order += [unit(warmup + i, False), unit(i, True)]
        order += [unit(i, True) for i in range(total - warmup, total)]
        stages.append(order)
    return Schedule("interleaved", P, K, v, stages)


def from_stage_fn(fn, P: int, K: int, name: str = "custom") -> Schedule:
    """Build a schedule from a function fn(p, P, K) -> list of actions for stage p."""
    return Schedule(name, P, K, 1, [list(fn(p, P, K)) for p in range(P)])
