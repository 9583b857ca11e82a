"""Zero-bubble schedules (Qi et al., 2023, arXiv:2401.10241): the backward split in two.

    from labkit.pipeline import zero_bubble
    s = zero_bubble.zb_h1(P=4, K=8)   # 1F1B's peak memory, about a third of its bubble
    s.stages[3]                       # [F0, B0, W0, F1, B1, W1, ...]

A backward does two things: the gradient with respect to the stage's input (B), which the stage
before is waiting for, and the gradients of the stage's weights (W), which nobody waits for
until the optimizer step. Run B at once and W later, in the holes where a stage would wait:
with t_F = t_B = t_W the idle time of a stage falls from 1F1B's (P-1)(t_F + t_B + t_W) to
(P-1)(t_F + t_B - t_W) for ZB-H1, a third. ZB-H2 also lets a stage hold more micro-batches
(up to 2P-1 on every stage instead of P-p), so that extra warm-up forwards fill the start and the
deferred W's fill the end: every stage is busy from its first forward to its last W, a
parallelogram, paid for in activation memory (W holds the activations it needs until it runs).

What the parallelogram buys depends on the step boundary. With a flush (all stages finish, then
the optimizer steps: labkit's executor, or any global gradient-norm all-reduce) the last stage
still waits (P-1) t_F for its first input and then has all its work to do, so no v = 1 schedule
idles less than (P-1) t_F per stage; ZB-H1 already gets there at t_F = t_B = t_W, and ZB-H2
idles (P-1) max(t_F, t_F + t_B - 2 t_W, t_B - t_F): it gains only where t_B > t_W. Without the
flush (the paper's optimizer post-validation, sec. 4: step at once, validate the global checks
afterwards and roll back in the rare step that needs it) the parallelograms tile, stage p
starting step i+1 while stage P-1 finishes step i: (P-1) max(0, t_F + t_B - 2 t_W, t_B - t_F)
per step, zero at equal times (labkit.pipeline.simulate.steady_state; the formulas are
labkit.costs.pipeline.schedule_bubble's, equal to the simulator).

ZB-H1 is the paper's hand-built order (`zb_h1`). ZB-H2 is built by list scheduling, in the
spirit of the paper's heuristic: simulate the pipeline
with unit times and let each stage, whenever it is free, run a ready B first (the critical
path), else a forward if its memory cap allows, else its oldest pending W. The order each stage
ran becomes the schedule: plain data, checked by labkit.pipeline.validate like any other.
Forwards and B's run in micro-batch order, so messages between two stages keep their order
(NCCL-safe: validate.check_message_order).

ZB-V (the paper's section 6, "zero bubble with V-shape"; `zb_v`) cuts the model into 2P chunks
and puts chunks r and 2P-1-r on stage r (schedules.v_placement): the forward goes down the
stages and comes back up, so the first and the last chunk (and the loss) are both on stage 0,
and the turn at the bottom is a hand-over inside stage P-1, no message. Each stage holds at
most 2P chunk-activations, each 1/(2P) of the model: 1F1B's peak (P whole-stage micro-batches);
with t_F = t_B = t_W (whole-stage times) and K >= 2P-1 a stage idles (P-1) t_F / 2, half
ZB-H1's (P-1) t_F: the ramp, walked in half-size chunks. Its order is PyTorch's
ScheduleZBVZeroBubble's; a stage needs some messages in another order than they are sent, so
under NCCL the executor posts those receives early (labkit.pipeline.posting.nccl_plan).
"""
from __future__ import annotations

from labkit.pipeline.base import Action, Schedule, check_sizes, one_f_one_b_stage, v_placement

CAPS = {  # micro-batches whose W has not run that stage p of P may hold
    "zb-h2": lambda p, P: 2 * P - 1,       # the paper's ZB-H2 peak
}


def split_backward(s: Schedule, name: str = None) -> Schedule:
    """The same order with every backward split into B then W at once (no deferral): the
    reference a zero-bubble schedule is compared with, and the start of chapter 05's exercise."""
    stages = [[x for a in actions for x in ((a, Action("W", a.mb, a.chunk)) if a.kind == "B"
                                            else (a,))] for actions in s.stages]
    return Schedule(name or s.name + "-split", s.P, s.K, s.v, stages)


def list_schedule(P: int, K: int, cap, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
                  name: str = "zb") -> Schedule:
    """Greedy order for v = 1: each free stage runs a ready B, else F (if below cap(p, P)
    micro-batches held), else its oldest pending W. Stages are served in the order of the time
    they decide at, so no message can arrive before a decision already taken."""
    check_sizes(P, K)
    caps = [max(1, min(K, cap(p, P))) for p in range(P)]
    free = [0.0] * P
    next_f = [0] * P                # next micro-batch to forward
    next_b = [0] * P                # next micro-batch to run B of
    pending_w = [[] for _ in range(P)]
    held = [0] * P                  # forwards whose W has not run (W needs their activations)
    f_arrive = {}                   # (stage, mb) -> time the forward input is there
    b_arrive = {}                   # (stage, mb) -> time the output gradient is there
    f_done = {}                     # (stage, mb) -> end of that forward
    orders = [[] for _ in range(P)]

    def options(p):
        """[(priority, ready time, action)] stage p could run next, given what has arrived."""
        out, k = [], next_b[p]
        if k < next_f[p]:
            ready = b_arrive.get((p, k)) if p < P - 1 else f_done[(p, k)]
            if ready is not None:
                out.append((0, ready, Action("B", k)))
        k = next_f[p]
        if k < K and held[p] < caps[p]:
            ready = 0.0 if p == 0 else f_arrive.get((p, k))
            if ready is not None:
                out.append((1, ready, Action("F", k)))
        if pending_w[p]:
            out.append((2, free[p], Action("W", pending_w[p][0])))
        return out

    def decide(p):
        """(time stage p starts its next action, the action), or None when nothing is known."""
        opts = options(p)
        if not opts:
            return None
        t = max(free[p], min(r for _, r, _ in opts))
        return t, min((pri, a) for pri, r, a in opts if r <= t)[1]

    total = 3 * K * P
    while sum(map(len, orders)) < total:
        choices = [(d[0], p, d[1]) for p in range(P) if (d := decide(p)) is not None]
        if not choices:
            raise RuntimeError(f"list scheduling stalled at P={P}, K={K} (a bug)")
        t, p, a = min(choices)
        dur = {"F": t_f, "B": t_b, "W": t_w}[a.kind]
        end = t + dur
        orders[p].append(a)
        free[p] = end
        if a.kind == "F":
            next_f[p] += 1
            held[p] += 1
            f_done[(p, a.mb)] = end
            if p < P - 1:
                f_arrive[(p + 1, a.mb)] = end
        elif a.kind == "B":
            next_b[p] += 1
            pending_w[p].append(a.mb)
            if p > 0:
                b_arrive[(p - 1, a.mb)] = end
        else:
            pending_w[p].pop(0)
            held[p] -= 1
    return Schedule(name, P, K, 1, orders)


def zb_h1(P: int, K: int) -> Schedule:
    """ZB-H1 (the paper's hand-built order): 1F1B with the backward split, and stage p running
    the W of micro-batch i only after the B of micro-batch i + p, so its last p W's fill the
    cool-down. Stage p then holds up to (P - p) + p = P micro-batches: 1F1B's peak (stage 0's),
    on every stage. Bubble (P-1)(t_F + t_B - t_W) per stage for K >= P."""
    check_sizes(P, K)
    stages = []
    for p in range(P):
        d, order = min(p, K), []
        for a in one_f_one_b_stage(p, P, K):
            order.append(a)
            if a.kind == "B" and a.mb >= d:
                order.append(Action("W", a.mb - d))
        stages.append(order + [Action("W", k) for k in range(K - d, K)])
    return Schedule("zb-h1", P, K, 1, stages)


def zb_h2(P: int, K: int) -> Schedule:
    """ZB-H2: up to 2P-1 micro-batches held on every stage; for K >= 2P-1 a parallelogram whose
    bubble is zero at equal times only when steps run back to back (see the module docstring)."""
    return list_schedule(P, K, CAPS["zb-h2"], name="zb-h2")


class _Stage:
    """One stage's order under construction, with a counter per (kind, local chunk): the next
    micro-batch of that kind to run there (each kind runs its micro-batches in order)."""

    def __init__(self):
        self.order, self.next = [], {(k, c): 0 for k in "FBW" for c in (0, 1)}

    def run(self, kind: str, chunk: int) -> None:
        self.order.append(Action(kind, self.next[kind, chunk], chunk))
        self.next[kind, chunk] += 1

    def behind(self, kind: str, chunk: int, ahead: str) -> bool:
        """True while `kind` has run fewer micro-batches of `chunk` than `ahead` has."""
        return self.next[kind, chunk] < self.next[ahead, chunk]


def zb_v_stage(r: int, P: int, n: int) -> list:
    """ZB-V's order on stage r for n >= 2P-1 micro-batches. Chunk 0 (global r) is on the way
    down, chunk 1 (global 2P-1-r) on the way up. With unit times micro-batch 0 reaches chunk 1
    here at time 2P-1-r, so the stage first fills that wait with chunk-0 forwards."""
    st = _Stage()
    for _ in range(2 * (P - r) - 1):   # warm-up 1: down-chunk forwards until the V comes back
        st.run("F", 0)
    for _ in range(r):                 # warm-up 2: the up-stream arrives every other slot
        st.run("F", 1)
        st.run("F", 0)
    for _ in range(P - r):             # warm-up 3: the first backwards of the up-chunk, W at
        for kind in "FBW":             # once (nothing else is ready to fill the slot)
            st.run(kind, 1)
    # steady state: one forward, B and W per chunk; memory stays at 1F1B's peak because each
    # W frees its activations right after its B
    while st.next["F", 0] < n or st.next["F", 1] < st.next["F", 0]:
        if st.next["F", 0] < n:
            st.run("F", 0)
        for kind in "BW":
            st.run(kind, 0)
        for kind in "FBW":
            st.run(kind, 1)
    for _ in range(r):                 # cool-down 1: only B's (what the stages below wait for)
        st.run("B", 0)
        st.run("B", 1)
    for _ in range(P - r):             # cool-down 2: B's, oldest deferred chunk-0 W between
        st.run("B", 0)
        st.run("W", 0)
    for c in (1, 0):                   # cool-down 3: the deferred W's fill the tail
        while st.behind("W", c, "B"):
            st.run("W", c)
    return st.order


def zb_v(P: int, K: int) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024, section 6): 2P chunks in a V (stage r holds r and 2P-1-r),
    1F1B's peak memory, bubble only the ramp when t_F = t_B = t_W. The hand-built order needs
    2P-1 micro-batches to fill the V; for K < 2P-1 it is built for 2P-1 and the extra
    micro-batches' actions are dropped (removing actions of whole micro-batches removes waits,
    never adds one, so the order stays valid; PyTorch's ScheduleZBVZeroBubble does the same).
    Any P >= 1, K >= 1; for K <= P its bubble is ZB-H1's (the ramp is all there is)."""
    check_sizes(P, K)
    n = max(K, 2 * P - 1)
    stages = [[a for a in zb_v_stage(r, P, n) if a.mb < K] for r in range(P)]
    return Schedule("zb-v", P, K, 2, stages, placement=v_placement(P))


def make(name: str, P: int, K: int, v: int = None) -> Schedule:
    if name == "zb-h1":
        return zb_h1(P, K)
    if name == "zb-h2":
        return zb_h2(P, K)
    if name == "zb-v":
        if v not in (None, 1, 2):
            raise ValueError(f"zb-v with P={P}, K={K}, v={v}: ZB-V has exactly 2 chunks per "
                             f"stage (v=2; v=1, the default, also means that)")
        return zb_v(P, K)
    raise ValueError(f"zero-bubble schedule {name!r}: choose 'zb-h1', 'zb-h2' or 'zb-v'")
