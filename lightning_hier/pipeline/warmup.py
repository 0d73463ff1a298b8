"""How many forwards each 1F1B stage runs before its first backward, and when more of them pay.

In 1F1B stage ``s`` of ``S`` runs ``S - s`` forwards before its first backward and then alternates one
backward with one forward. That keeps the fewest activations in flight, but where an early stage is
slower than the stages after it, it waits for each gradient although it could already run the next
micro-batch's forward: on a skewed 2-stage stack (9 narrow blocks, then 7 wide ones; stage 0 13.7 ms per
micro-batch, stage 1 11.9 ms, 4 micro-batches) the step is 64.9 ms in 1F1B and 61.3 ms with one extra
warm-up forward on stage 0, which is also the least any schedule can reach there (stage 0's first
forward, then every one of stage 1's micro-batches, then stage 0's last backward).

A stage's extra warm-up forwards raise the count of every stage before it as well: stage ``s`` can run
its forwards only on activations stage ``s - 1`` sent before waiting for its own first gradient. So the
counts are ``w[S-1] = 1`` and ``w[s] = w[s+1] + 1 + extra[s]``, at most the number of micro-batches, and
each extra forward holds one more micro-batch's activations on the stages up to ``s``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def warmup_counts(num_stages: int, num_micro: int, extra: Sequence[int] = ()) -> list[int]:
    """Forwards before the first backward, per stage: 1F1B's ``S - s`` plus the extra ones of this stage and
    of every later stage (``extra[s]``, missing entries 0; the last stage's is ignored), at most
    ``num_micro``."""
    counts = [0] * num_stages
    running = 0
    for stage in reversed(range(num_stages)):
        more = extra[stage] if stage < min(len(extra), num_stages - 1) else 0
        if more < 0:
            raise ValueError(f"extra warm-up forwards must be >= 0, got {list(extra)}.")
        running += 1 + more
        counts[stage] = min(running, num_micro)
    return counts


def simulate_step(
    forward: Sequence[float], backward: Sequence[float], num_micro: int, warmups: Sequence[int]
) -> float:
    """The step time of 1F1B with these warm-up counts, from each stage's forward and backward time per
    micro-batch (messages taken as free): stage ``s`` runs its operations in its own order, a forward
    once the previous stage's forward of the same micro-batch is done, a backward once the next
    stage's backward of it is done."""
    stages = len(forward)
    orders = [_stage_order(num_micro, warmups[s]) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                if kind == "F":
                    needs = done.get(("F", s - 1, m)) if s > 0 else 0.0
                else:
                    needs = done.get(("B", s + 1, m)) if s < stages - 1 else done[("F", s, m)]
                if needs is None:
                    break
                start = max(free[s], needs)
                free[s] = done[(kind, s, m)] = start + (forward[s] if kind == "F" else backward[s])
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ValueError(
                f"warm-up counts {list(warmups)} deadlock: a stage waits for one that waits for it."
            )
    return max(free)


def _stage_order(num_micro: int, warmup: int) -> list[tuple[str, int]]:
    order = [("F", m) for m in range(warmup)]
    fwd = warmup
    for bwd in range(num_micro):
        order.append(("B", bwd))
        if fwd < num_micro:
            order.append(("F", fwd))
            fwd += 1
    return order


def choose_extra_warmup(
    forward: Sequence[float],
    backward: Sequence[float],
    num_micro: int,
    min_gain: float = 0.01,
    fits: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Extra warm-up forwards per stage that shorten the simulated step: one at a time, where it saves
    the most, as long as each saves at least ``min_gain`` of the step (every one holds one more
    micro-batch's activations) and ``fits`` accepts the warm-up counts it leads to (memory). All zeros
    where stages after a stage are as slow as it (1F1B's own counts are then already the best)."""
    stages = len(forward)
    extra = [0] * stages
    best = simulate_step(forward, backward, num_micro, warmup_counts(stages, num_micro, extra))
    while True:
        trials = []
        for s in range(stages - 1):
            tried = list(extra)
            tried[s] += 1
            counts = warmup_counts(stages, num_micro, tried)
            if counts == warmup_counts(stages, num_micro, extra):
                continue  # capped at the micro-batch count: nothing changes
            if fits is not None and not fits(counts):
                continue
            trials.append((simulate_step(forward, backward, num_micro, counts), s, tried))
        if not trials:
            return extra
        time, _, tried = min(trials)
        if time > best * (1.0 - min_gain):
            return extra
        best, extra = time, tried


MEMORY_SHARE = 0.9  # of a device's memory that extra warm-up forwards may bring a stage's peak up to


def fits_in_memory(
    peaks: Sequence[int], capacities: Sequence[int | None], current: Sequence[int], proposed: Sequence[int]
) -> bool:
    """Whether every stage's memory holds the micro-batches ``proposed`` keeps in flight: a stage's peak
    (``peaks``, measured while it held ``current`` of them) grows at most in proportion to its count, and
    must stay within ``MEMORY_SHARE`` of its device's ``capacities`` (``None``: host memory, not checked)."""
    for peak, capacity, held, more in zip(peaks, capacities, current, proposed):
        if capacity is None or more <= held:
            continue
        if peak * more / max(held, 1) > MEMORY_SHARE * capacity:
            return False
    return True
