"""When each stage posts its receives: a plan that cannot deadlock under NCCL's rules.

The executor (labkit.pipeline.executor) posts, before each action i of a stage, one batch of
point-to-point messages (labkit.collectives.exchange): the output of action i-1 to its
consumer, and the receives that `plan[i]` lists, by default action i's own input. On Gloo a
send returns at once and the receive matches by tag, so any valid schedule runs
(labkit.pipeline.validate). Under NCCL two rules are stricter:

1. a stage's batches run one at a time, in the order posted (one GPU stream);
2. a batch finishes only when every message in it has been taken: a send waits for its
   receive to be posted ("point-to-point calls within a group will be blocking until that
   group of calls completes", NCCL's documentation).

GPipe and 1F1B run as they are. Interleaved 1F1B does not: stage 0 can hold a batch that only
sends, waiting for stage 1 to post that receive, while stage 1 waits in an earlier batch for a
message stage 0 will only receive in its next batch. `plan(s)` replays the default under rules
1-2 (`stuck`) and, while some stage is stuck, posts that stage's next receive one batch
earlier: a prefetch, as Megatron-LM's interleaved schedule receives the next micro-batch while
sending the last (the buffer's shape is known in advance). Receives keep their order, so each
pair of stages still exchanges its messages in the same order on both ends
(validate.check_message_order). A hand-over between two chunks of one stage (ZB-V's turn at
the bottom of the V) is no message: it appears in no batch.
"""
from __future__ import annotations

from labkit.pipeline.schedules import Schedule
from labkit.pipeline.validate import ScheduleError, is_local, needs, produces


def _message(s: Schedule, key):
    """`key` if it travels between two stages; None for no key or a hand-over inside a stage."""
    return key if key is not None and not is_local(s, key) else None


def default_plan(s: Schedule) -> list:
    """plan[p][i]: indices of stage p's actions whose input is received in batch i (posted
    before action i; batch len(actions) is the last, sends only). Default: each its own."""
    return [[[i] if _message(s, needs(s, p, a)) is not None else [] for i, a in enumerate(actions)]
            + [[]] for p, actions in enumerate(s.stages)]


def batches(s: Schedule, plan: list, p: int) -> list:
    """Stage p's batches: [(batch index, message keys sent, message keys received)], in order,
    empty batches left out."""
    actions = s.stages[p]
    out = []
    for i in range(len(actions) + 1):
        sent = _message(s, produces(s, p, actions[i - 1])) if i > 0 else None
        sends = [sent] if sent is not None else []
        recvs = [needs(s, p, actions[j]) for j in plan[p][i]]
        if sends or recvs:
            out.append((i, sends, recvs))
    return out


def stuck(s: Schedule, plan: list) -> dict:
    """Replay the plan under rules 1-2: {stage: index into batches(s, plan, stage) it is stuck
    at} ({} when every batch completes). A message goes through when the sender's current batch
    holds its send and the receiver's current batch its receive."""
    todo = [batches(s, plan, p) for p in range(s.P)]
    head = [0] * s.P
    done = [set() for _ in range(s.P)]
    progress = True
    while progress:
        progress = False
        current = {p: todo[p][head[p]] for p in range(s.P) if head[p] < len(todo[p])}
        receiving = {key: p for p, (_, _, recvs) in current.items() for key in recvs}
        for p, (_, sends, _) in current.items():
            for key in sends:
                q = receiving.get(key)
                if q is not None and ("send", key) not in done[p]:
                    done[p].add(("send", key))
                    done[q].add(("recv", key))
                    progress = True
        for p, (_, sends, recvs) in current.items():
            if {("send", k) for k in sends} | {("recv", k) for k in recvs} <= done[p]:
                head[p], done[p], progress = head[p] + 1, set(), True
    return {p: head[p] for p in range(s.P) if head[p] < len(todo[p])}


def plan(s: Schedule) -> list:
    """A posting plan for `s` that completes under NCCL's rules (see the module's docstring).
    Raise ScheduleError naming the stuck stages when prefetching cannot unblock it."""
    out = default_plan(s)
    while True:
        blocked = stuck(s, out)
        if not blocked:
            return out
        moved = False
        for p, k in sorted(blocked.items()):
            at = batches(s, out, p)[k][0]                       # batch index the stage waits in
            later = next((i for i in range(at + 1, len(out[p])) if out[p][i]), None)
            if later is not None:                               # prefetch its next receive
                out[p][at].append(out[p][later].pop(0))
                moved = True
        if not moved:
            raise ScheduleError(
                f"no order of posting receives lets schedule {s.name!r} (P={s.P}, K={s.K}, "
                f"v={s.v}) run under NCCL: stages {sorted(blocked)} stay blocked; run it on Gloo")
