"""The clairvoyant optimum of independent tasks on nodes of known speeds (#17's bound).

Given the tasks' lengths at speed 1 and each one-CPU node's speed (1: nominal, ``1/f``:
``f`` times slower, 0: hung), no schedule ends before the best assignment of tasks to
nodes: whatever a scheduler does (duplicates, cancels), each task's result comes from
one copy that ran from its start to its end on one node, and those winning copies never
overlap on a node. A copy's work is not carried over to another, so the assignment
optimum (``Q||Cmax``) bounds every schedule, work-conserving or not. The final task
reading every result starts after the last of them, on a fastest node.

``optimum`` searches it exactly: branch and bound over the tasks, longest first, each
on every node (nodes of equal speed and equal load are one choice), pruned by the best
found and by ``max(the busiest node, the soonest end of the next task, the work left
poured onto the nodes from where each is busy till)``, and by counting: each node
holds at most as many more tasks as the shortest ones left that fit in its room under
the best makespan found, and together they must hold every task left. Where the search
exceeds ``limit`` expansions it gives up, and ``bound`` falls back to the fractional
bound ``max(longest task, total work / summed speeds)``, saying so.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Bound:
    seconds: float  # the lower bound, final task included
    exact: bool  # the assignment optimum (else the fractional bound)
    fractional: float  # max(longest, work / summed speeds) + final, for comparison
    how: str  # the arithmetic, printed by the benchmark


def fractional(lengths: Sequence[float], speeds: Sequence[float]) -> float:
    """No schedule beats max(longest task on a fastest node, work / summed speeds)."""
    live = [s for s in speeds if s > 0]
    return max(max(lengths) / max(live), sum(lengths) / sum(live))


def optimum(
    lengths: Sequence[float], speeds: Sequence[float], limit: int = 2_000_000
) -> tuple[float, list[int]] | None:
    """The least makespan over assignments of ``lengths`` to nodes of ``speeds`` and one
    assignment reaching it (node index per task, in the order given); ``None``: the
    search took more than ``limit`` expansions."""
    nodes = [j for j, s in enumerate(speeds) if s > 0]
    if not nodes:
        raise ValueError("no node with a speed above 0")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    xs = [lengths[i] for i in order]
    sp = [speeds[j] for j in nodes]
    rest = [0.0] * (len(xs) + 1)  # work from task i on
    for i in range(len(xs) - 1, -1, -1):
        rest[i] = rest[i + 1] + xs[i]
    # a first solution: each task where it would end soonest (longest first)
    load = [0.0] * len(sp)
    greedy = []
    for x in xs:
        j = min(range(len(sp)), key=lambda j: (load[j] + x) / sp[j])
        load[j] += x
        greedy.append(j)
    best = [max(load[j] / sp[j] for j in range(len(sp))), greedy]
    floor = fractional(xs, sp) if xs else 0.0
    load = [0.0] * len(sp)
    pick = [0] * len(xs)
    expansions = 0
    small = [0.0]  # small[k]: the k shortest tasks' work (the last k of ``xs``)
    for x in reversed(xs):
        small.append(small[-1] + x)
    eps = 1e-12

    def go(i: int) -> bool:  # False: out of budget
        nonlocal expansions
        if best[0] <= floor + eps:  # nothing beats the fractional bound
            return True
        if i == len(xs):
            span = max(load[j] / sp[j] for j in range(len(sp)))
            if span < best[0] - eps:
                best[0], best[1] = span, list(pick)
            return True
        expansions += 1
        if expansions > limit:
            return False
        ends = [load[j] / sp[j] for j in range(len(sp))]
        soonest = min(e + xs[i] / s for e, s in zip(ends, sp, strict=True))
        if max(max(ends), soonest, _level(ends, sp, rest[i])) >= best[0] - eps:
            return True
        # to beat the best, node j can take at most as many more tasks as its room holds
        # of the shortest ones left; together they must hold every task left
        left = len(xs) - i
        fits = 0
        for e, s in zip(ends, sp, strict=True):
            room = (best[0] - eps - e) * s
            fits += min(left, bisect_right(small, room + eps) - 1)
        if fits < left:
            return True
        tried = set()
        # the nodes where this task ends soonest first: good solutions early
        for j in sorted(range(len(sp)), key=lambda j: (load[j] + xs[i]) / sp[j]):
            if (sp[j], load[j]) in tried:
                continue
            tried.add((sp[j], load[j]))
            if (load[j] + xs[i]) / sp[j] >= best[0] - eps:
                continue
            load[j] += xs[i]
            pick[i] = j
            ok = go(i + 1)
            load[j] -= xs[i]
            if not ok:
                return False
        return True

    if not go(0):
        return None
    assign = [0] * len(xs)
    for pos, i in enumerate(order):
        assign[i] = nodes[best[1][pos]]
    return best[0], assign


def _level(ends: list[float], speeds: list[float], work: float) -> float:
    """When ``work`` left, poured onto nodes busy till ``ends``, ends at the earliest
    (each node takes work from its end on at its speed: the fractional bound from here)."""
    pairs = sorted(zip(ends, speeds, strict=True))
    speed = 0.0
    for k, (_, s) in enumerate(pairs):
        speed += s
        nxt = pairs[k + 1][0] if k + 1 < len(pairs) else math.inf
        # nodes 0..k run from their ends up to ``nxt``
        room = sum(sj * (nxt - ej) for ej, sj in pairs[: k + 1])
        if room >= work:
            filled = sum(sj * ej for ej, sj in pairs[: k + 1])
            return (work + filled) / speed
    return math.inf


def bound(
    lengths: Sequence[float], speeds: Sequence[float], final: float, limit: int = 2_000_000
) -> Bound:
    """The clairvoyant optimum plus ``final`` on a fastest node; the fractional bound
    where the exact search is too big (``exact`` False)."""
    fast = max(s for s in speeds if s > 0)
    frac = fractional(lengths, speeds) + final / fast
    got = optimum(lengths, speeds, limit)
    live = [s for s in speeds if s > 0]
    speeds_txt = " + ".join(f"{s:.3g}" for s in sorted(set(live), reverse=True))
    frac_txt = (
        f"fractional max({max(lengths):.2f}, {sum(lengths):.2f} / ({speeds_txt} "
        f"over {len(live)} nodes)) + {final:g} = {frac:.2f}"
    )
    if got is None:
        return Bound(frac, False, frac, f"{frac_txt} (exact search too big)")
    span, assign = got
    work = [0.0] * len(speeds)
    for x, j in zip(lengths, assign, strict=True):
        work[j] += x
    nodes_txt = ", ".join(f"{w:.2f}/{s:.3g}" for w, s in zip(work, speeds, strict=True) if s > 0)
    exact = span + final / fast
    how = (
        f"exact {span:.2f} (work/speed per node: {nodes_txt}) + {final:g} = {exact:.2f}; {frac_txt}"
    )
    return Bound(exact, True, frac, how)


def blind(
    lengths: Sequence[float],
    speeds: Sequence[float],
    final: float,
    avoid: float = 3.0,
    orders: int = 2000,
    seed: int = 0,
) -> list[float]:
    """What a scheduler blind to the tasks' lengths, but told the nodes' speeds, makes
    of them: the tasks in ``orders`` random orders, each given to the node free first
    (list scheduling; no duplicates), on the nodes less than ``avoid`` times slower
    than the fastest (raydag's ``slow-node`` rule keeps first copies off the others),
    then ``final`` on a fastest node. The makespans, sorted.

    The clairvoyant ``bound`` knows every length; an online scheduler of one category
    knows none until a task ends, so which long task starts last is the order's luck.
    Worked example: #17's 6n 5x short mixed (17 tasks, 9 of 0.19-0.37 s and 8 of
    1.25-1.76 s, bound 2.93 s): on the five nodes not slowed, a random order ends at
    a median 1.23x the bound and past 1.3x in 17 % of orders; longest first, 1.04x.
    """
    fast = max(speeds)
    used = sorted((s for s in speeds if s > 0 and s * avoid > fast), reverse=True)
    rng = random.Random(seed)
    spans = []
    for _ in range(orders):
        order = list(lengths)
        rng.shuffle(order)
        free = [0.0] * len(used)  # when each node is next free; ties to the fastest
        for x in order:
            j = min(range(len(used)), key=free.__getitem__)
            free[j] += x / used[j]
        spans.append(max(free) + final / fast)
    return sorted(spans)


def speeds_of(nodes: int, factor: float) -> list[float]:
    """One-CPU nodes, the first ``factor`` times slower (``inf``: hung)."""
    return [0.0 if factor == math.inf else 1.0 / factor] + [1.0] * (nodes - 1)
