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

NCCL also ignores tags: it pairs a pair of stages' messages in the order they are posted. A
schedule whose stage needs a pair's messages in another order than they are sent (ZB-V for
K > P: an activation going down is sent before a gradient the receiver needs first) still runs
if the receiver POSTS its receives in the sender's order: `send_order_plan` posts each receive
no later than every receive from the same sender sent after it (a prefetch into a buffer whose
shape is known). `nccl_plan` picks: the plan above where the orders already agree (GPipe, 1F1B,
interleaved, ZB-H1/H2: unchanged), else the send-ordered one, where two stages that would
both wait in a send-only batch receive each other's message in it (as Megatron-LM's
send_forward_recv_backward does), checked by `check_posted_order` and `stuck`.
"""
from __future__ import annotations

from labkit.pipeline.base import Schedule
from labkit.pipeline.validate import (
    ScheduleError,
    _describe,
    check_message_order,
    is_local,
    message_orders,
    needs,
    produces,
    receiver,
)


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


def send_order_plan(s: Schedule) -> list:
    """A plan in which every stage posts the receives from each sender in the order that sender
    sends them: walking the sent messages backwards, each receive is posted in its own action's
    batch or in the batch of the next one sent, whichever is earlier."""
    out = [[[] for _ in range(len(actions) + 1)] for actions in s.stages]
    for (_src, dst), (sent, _) in sorted(message_orders(s).items()):
        index = {needs(s, dst, a): i for i, a in enumerate(s.stages[dst])}  # key -> action
        at, batch = {}, len(s.stages[dst])
        for key in reversed(sent):
            batch = min(batch, index[key])
            at[key] = batch
        for key in sent:                  # within a batch, in the order sent
            out[dst][at[key]].append(index[key])
    return out


def posted_order(s: Schedule, plan: list) -> dict:
    """{(sender, receiver): message keys in the order the receiver posts their receives}."""
    out = {}
    for p in range(s.P):
        for batch in plan[p]:
            for j in batch:
                key = needs(s, p, s.stages[p][j])
                out.setdefault((s.stage_of(key[2]), p), []).append(key)
    return out


def check_posted_order(s: Schedule, plan: list) -> None:
    """Raise ScheduleError where a stage posts a pair's receives in another order than the
    sender sends them (NCCL would pair a message with the wrong receive)."""
    posted = posted_order(s, plan)
    for (src, dst), (sent, _) in sorted(message_orders(s).items()):
        got = posted.get((src, dst), [])
        if got != sent:
            i = next((i for i, (a, b) in enumerate(zip(sent, got)) if a != b),
                     min(len(sent), len(got)))
            raise ScheduleError(f"stage {dst} posts its receives from stage {src} in another order "
                                f"than stage {src} sends: message #{i} is "
                                f"{_describe(sent[i], s) if i < len(sent) else 'none'}")


def nccl_plan(s: Schedule) -> list:
    """The plan the executor posts (on both backends): `plan(s)` where each pair's messages are
    needed in the order sent; else `send_order_plan(s)`, with the receives that two stages
    sending to each other at once need moved into their current batches. Raise ScheduleError
    when it cannot complete under NCCL's rules."""
    try:
        check_message_order(s)
    except ScheduleError as err:
        out = send_order_plan(s)
        while _receive_what_is_sent(s, out):
            pass
        if stuck(s, out):
            raise ScheduleError(f"no order of posting receives lets schedule {s.name!r} (P={s.P}, "
                                f"K={s.K}, v={s.v}) run under NCCL: stages {sorted(stuck(s, out))} "
                                f"stay blocked; run it on Gloo") from err
        check_posted_order(s, out)
        return out
    return plan(s)


def _sender_and_position(s: Schedule, stage: int, i: int, sent_at: dict) -> tuple:
    """(sender, position in the sender's sending order) of the input of `stage`'s action i."""
    key = needs(s, stage, s.stages[stage][i])
    return s.stage_of(key[2]), sent_at[key]


def _receive_what_is_sent(s: Schedule, out: list) -> bool:
    """One step of settling a send-ordered plan: where a stuck stage's current batch sends a
    message whose receive its receiver posts only in a later batch (two stages each sending
    first: the deadlock Megatron's send_forward_recv_backward avoids), move that receive into
    the receiver's current batch, kept in the sender's order. False when nothing moved."""
    blocked = stuck(s, out)
    heads = {p: batches(s, out, p)[k][0] for p, k in blocked.items()}
    sent_at = {key: i for sent, _ in message_orders(s).values() for i, key in enumerate(sent)}
    moved = False
    for p in sorted(blocked):
        for key in batches(s, out, p)[blocked[p]][1]:       # what p's current batch sends
            r = receiver(s, key)
            if r not in heads:
                continue
            j = next(j for j, a in enumerate(s.stages[r]) if needs(s, r, a) == key)
            b = next(i for i, batch in enumerate(out[r]) if j in batch)
            if b <= heads[r]:                                # received already, or matched now
                continue
            out[r][b].remove(j)
            out[r][heads[r]].append(j)
            # NCCL pairs per sender: keep each sender's receives in its sending order
            out[r][heads[r]].sort(key=lambda i, r=r: _sender_and_position(s, r, i, sent_at))
            moved = True
    return moved


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
