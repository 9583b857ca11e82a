"""Is a pipeline schedule runnable? Dependencies and deadlock, with the first bad action named.

    from labkit.pipeline import schedules, validate
    validate.validate(schedules.one_f_one_b(4, 8))      # passes silently
    validate.validate(my_schedule)         # ScheduleError: stage 1, action #0 (B0): ...

The rules (what the executor needs to run it on real processes):
1. every stage runs the forward and the backward of every (micro-batch, chunk) it owns, once;
2. on a stage, the backward of a micro-batch comes after its forward (it needs the activations);
3. a forward needs the previous chunk's output (from the stage before), a backward needs the
   next chunk's input gradient (from the stage after): these arrive as messages;
4. no deadlock. Sends are posted without waiting (isend) and a receive blocks until its message
   has been sent, so the schedule deadlocks exactly when every unfinished stage waits for a
   message that its sender will only send after an action that is itself waiting.

Rule 4 is checked by replaying the schedule (`replay`), which `simulate` also uses for times.
Where a schedule's placement puts two consecutive chunks on one stage (ZB-V's turn at the
bottom of the V), the hand-over is no message (`is_local`): the dependency stays, the transfer
does not.
Under NCCL one more rule (`check_message_order`): between two stages, messages are received in
the order they are sent (NCCL ignores tags).
"""
from __future__ import annotations

from labkit.pipeline.base import Action, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the first bad action."""


def needs(s: Schedule, stage: int, a: Action):
    """The message key action `a` on `stage` waits for, or None (first/last chunk; W)."""
    if a.kind == "W":
        return None
    g = s.global_chunk(stage, a.chunk)
    if a.kind == "F":
        return ("F", a.mb, g - 1) if g > 0 else None
    return ("B", a.mb, g + 1) if g < s.n_chunks - 1 else None


def produces(s: Schedule, stage: int, a: Action):
    """The message key action `a` sends when done, or None (W sends nothing)."""
    if a.kind == "W":
        return None
    g = s.global_chunk(stage, a.chunk)
    if a.kind == "F":
        return ("F", a.mb, g) if g < s.n_chunks - 1 else None
    return ("B", a.mb, g) if g > 0 else None


def receiver(s: Schedule, key) -> int:
    """The stage a message key goes to: the next chunk's (F) or the previous chunk's (B)."""
    kind, _, g = key
    return s.stage_of(g + 1 if kind == "F" else g - 1)


def is_local(s: Schedule, key) -> bool:
    """True when the key's producer and consumer chunks are on the same stage: no message."""
    return s.stage_of(key[2]) == receiver(s, key)


def _describe(key, s: Schedule) -> str:
    kind, mb, g = key
    what = "activation" if kind == "F" else "gradient"
    return f"the {what} of micro-batch {mb} from stage {s.stage_of(g)}"


def check_structure(s: Schedule) -> None:
    """Rules 1 and 2: right actions, each once, backward after forward on the same stage (and,
    in a split schedule, every B followed later by its W)."""
    split = s.split
    if len(s.stages) != s.P:
        raise ScheduleError(f"the schedule has {len(s.stages)} stage lists, expected P={s.P}")
    check_placement(s)
    for p, actions in enumerate(s.stages):
        seen = {}
        for i, a in enumerate(actions):
            where = f"stage {p}, action #{i} ({a!r})"
            if not isinstance(a, Action) or a.kind not in ("F", "B", "W"):
                raise ScheduleError(f"stage {p}, action #{i}: {a!r} is not an action; use "
                                    f"F(mb), B(mb) or W(mb) from labkit.pipeline.schedules")
            if not 0 <= a.mb < s.K:
                raise ScheduleError(f"{where}: micro-batch {a.mb} is out of range 0..{s.K - 1} "
                                    f"for K={s.K}")
            if not 0 <= a.chunk < s.v:
                raise ScheduleError(f"{where}: chunk {a.chunk} is out of range 0..{s.v - 1} "
                                    f"for v={s.v}")
            if a in seen:
                raise ScheduleError(f"{where}: {a!r} runs twice on stage {p} (first at "
                                    f"#{seen[a]}); each forward and backward runs once")
            if a.kind == "B" and Action("F", a.mb, a.chunk) not in seen:
                raise ScheduleError(f"{where}: the backward of micro-batch {a.mb} comes before "
                                    f"its forward on stage {p}; it needs that forward's "
                                    f"activations")
            if a.kind == "W" and Action("B", a.mb, a.chunk) not in seen:
                raise ScheduleError(f"{where}: the weight gradient of micro-batch {a.mb} comes "
                                    f"before its B on stage {p}; W needs the gradient B computes")
            seen[a] = i
        for k in range(s.K):
            for c in range(s.v):
                for kind in ("F", "B", "W") if split else ("F", "B"):
                    if Action(kind, k, c) not in seen:
                        raise ScheduleError(f"stage {p} never runs {Action(kind, k, c)!r}: every "
                                            f"stage runs F and B{' and W' if split else ''} of "
                                            f"all K={s.K} micro-batches")


def check_placement(s: Schedule) -> None:
    """A placement (None: round robin) gives each of the P*v chunks a stage, v chunks each."""
    if s.placement is None:
        return
    if len(s.placement) != s.n_chunks:
        raise ScheduleError(f"placement has {len(s.placement)} entries, expected P*v = "
                            f"{s.n_chunks} (one stage per global chunk)")
    for p in range(s.P):
        held = [g for g, q in enumerate(s.placement) if q == p]
        if len(held) != s.v:
            raise ScheduleError(f"placement {list(s.placement)} puts chunks {held} on stage {p}; "
                                f"every stage holds v={s.v}")


def replay(s: Schedule, duration=lambda stage, a: 1.0, t_p2p: float = 0.0):
    """Run the schedule on paper: each stage in its own order; an action starts when the stage
    is free and its message has arrived (sent at the producer's end, + t_p2p).

    Returns (records, stuck): records[p] = [(action, start, end), ...]; stuck = {p: index of the
    action stage p is blocked at} ({} when every stage finished)."""
    arrived = {}                        # message key -> time it is available at the receiver
    pos = [0] * s.P
    free = [0.0] * s.P
    records = [[] for _ in range(s.P)]
    progress = True
    while progress:
        progress = False
        for p in range(s.P):
            while pos[p] < len(s.stages[p]):
                a = s.stages[p][pos[p]]
                key = needs(s, p, a)
                if key is not None and key not in arrived:
                    break
                start = max(free[p], arrived.get(key, 0.0))
                end = start + duration(p, a)
                records[p].append((a, start, end))
                out = produces(s, p, a)
                if out is not None:  # a hand-over inside the stage travels no link
                    arrived[out] = end + (0.0 if is_local(s, out) else t_p2p)
                free[p], pos[p], progress = end, pos[p] + 1, True
    stuck = {p: pos[p] for p in range(s.P) if pos[p] < len(s.stages[p])}
    return records, stuck


def validate(s: Schedule) -> None:
    """Raise ScheduleError naming the first bad action; return None when the schedule is valid."""
    check_structure(s)
    _, stuck = replay(s)
    if not stuck:
        return
    sender = {}  # message key -> (stage, index) of the action that sends it
    for p, actions in enumerate(s.stages):
        for i, a in enumerate(actions):
            out = produces(s, p, a)
            if out is not None:
                sender[out] = (p, i)
    lines = []
    for p, i in sorted(stuck.items()):
        a = s.stages[p][i]
        key = needs(s, p, a)
        q, j = sender[key]
        lines.append(f"stage {p}, action #{i} ({a!r}) waits for {_describe(key, s)}, which stage "
                     f"{q} sends only at its action #{j} ({s.stages[q][j]!r}), after #{stuck[q]} "
                     f"({s.stages[q][stuck[q]]!r}) where it is itself waiting")
    raise ScheduleError("deadlock: every unfinished stage waits for a message that is never "
                        "sent.\n" + "\n".join(lines))


def message_orders(s: Schedule) -> dict:
    """{(sender, receiver): (keys in the order the sender sends them, keys in the order the
    receiver waits for them)} for every pair of stages that exchange messages (hand-overs
    inside a stage are no messages)."""
    orders = {}
    for p, actions in enumerate(s.stages):
        for a in actions:
            out, need = produces(s, p, a), needs(s, p, a)
            if out is not None and not is_local(s, out):
                orders.setdefault((p, receiver(s, out)), ([], []))[0].append(out)
            if need is not None and not is_local(s, need):
                orders.setdefault((s.stage_of(need[2]), p), ([], []))[1].append(need)
    return orders


def check_message_order(s: Schedule) -> None:
    """NCCL ignores tags: between two stages it hands over messages in the order they were sent.
    Raise ScheduleError when some stage would receive a pair's messages in another order than
    they were sent (the executor would then pair a message with the wrong receive)."""
    for (src, dst), (sent, wanted) in sorted(message_orders(s).items()):
        if sent != wanted:
            i = next(i for i, (a, b) in enumerate(zip(sent, wanted)) if a != b)
            raise ScheduleError(
                f"stage {src} sends its messages to stage {dst} in another order than stage "
                f"{dst} receives them: message #{i} is {_describe(sent[i], s)} but stage {dst} "
                f"waits for {_describe(wanted[i], s)}. Gloo matches them by tag; NCCL only in "
                f"order: reorder the actions, or run this schedule on Gloo")

