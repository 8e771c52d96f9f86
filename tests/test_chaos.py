"""The fault tests' oracle (tests/chaos.py) on made-up task runs: no cluster.

A chain ``a -> b -> c`` (``c`` the output) of values too big to be inlined, on nodes
A, B and C; two deaths.
"""

from __future__ import annotations

import pytest
from chaos import INLINE_BYTES, Death, RaydagLog, Run, T, expected_recovery

# the state machine alone: the same on every dask version, run by the tests session only
pytestmark = pytest.mark.core_only

BIG = 2 * INLINE_BYTES
SPEC = {"a": T(0.1, BIG, 1.0), "b": T(0.1, BIG, 0.0, ("a",)), "c": T(0.1, BIG, 0.0, ("b",))}


def retried(t: float, key: str) -> tuple[float, str]:
    return t, f"raydag: the node running {key!r} died; retrying it"


def died(t: float, node: str) -> tuple[float, str]:
    return t, f"raydag: node {node} died"


def oracle(done: list[Run], deaths: list[Death], records: list) -> tuple:
    log = RaydagLog()
    log.records = records
    for d in deaths:
        d.t_seen = log.seen(d)
    log.note_cuts(deaths)
    exp = expected_recovery(SPEC, ["c"], done, deaths)
    return exp, log


def test_a_retry_belongs_to_its_own_death():
    # b ran on A (its result reached the driver) and was read by c on C, still running
    # when A died: nothing lost. b ran again on B (after a wave elsewhere, say) and B
    # died while it ran: the retry logged then is B's, not A's.
    done = [
        Run("a", "C", 1, 0.0, 1.0),
        Run("b", "A", 2, 1.0, 2.0),
        Run("c", "C", 1, 2.5, 30.0),
        Run("b", "B", 3, 20.0, 20.5),
    ]
    deaths = [Death("A", 10.0, 10.1), Death("B", 20.6, 20.7)]
    records = [died(11.5, "A"), retried(20.65, "b"), died(22.0, "B")]
    exp, _ = oracle(done, deaths, records)
    assert [d.cut for d in deaths] == [set(), {"b"}]
    # The run on B noted its end and never reached the driver: cut, owed once more.
    # The run on A is not: its result reached the driver long before.
    assert [(r.label, r.node) for r in exp.cut] == [("b", "B")]
    assert exp.completions["b"] == 2


def test_a_run_reset_by_a_wave_is_not_the_one_retried():
    # b made on A, lost when A died (c had not started): recomputed in the wave, with
    # its released input a. B dies while running b's rerun: the retry logged then must
    # not turn an older run of b (before the wave reset it) into a cut one.
    done = [
        Run("a", "C", 1, 0.0, 1.0),
        Run("b", "A", 2, 1.0, 2.0),
        Run("a", "C", 1, 7.0, 7.5),  # released once b was made: recomputed for b
        Run("b", "B", 3, 8.0, None),  # killed with B
        Run("b", "C", 1, 12.0, 12.5),
        Run("c", "C", 1, 12.6, 13.0),
    ]
    deaths = [Death("A", 5.0, 5.1), Death("B", 9.0, 9.1)]
    records = [died(6.5, "A"), retried(9.05, "b"), died(10.5, "B")]
    exp, _ = oracle(done, deaths, records)
    assert exp.cut == []
    assert exp.lost == [{"b"}, set()]
    assert exp.recompute == [{"a", "b"}, set()]
    assert exp.completions == {"a": 2, "b": 2, "c": 1}


def test_a_fused_member_that_ended_in_its_groups_task_is_cut_with_it():
    # a and b ran as one Ray task on B (b read a inside it): B died after a noted its
    # end, while b ran. The driver names the group's root and its other tasks: a
    # made no value (it never left the task), so it runs again with b.
    done = [
        Run("a", "B", 3, 1.0, 2.0),
        Run("b", "B", 3, 2.0, None),  # killed with B
        Run("a", "C", 1, 6.0, 7.0),
        Run("b", "C", 1, 7.0, 8.0),
        Run("c", "C", 1, 8.0, 9.0),
    ]
    deaths = [Death("B", 3.0, 3.1)]
    records = [
        (3.05, "raydag: the node running 'b' died; retrying it (with 'a' in its Ray task)"),
        died(4.0, "B"),
    ]
    exp, _ = oracle(done, deaths, records)
    assert deaths[0].cut == {"a", "b"}
    assert [(r.label, r.node) for r in exp.cut] == [("a", "B")]
    assert exp.completions == {"a": 2, "b": 1, "c": 1}


def test_a_reader_that_started_after_the_kill_keeps_its_input():
    # b made on A; c on C started after the kill began (its fetch of b ended while A
    # was being killed) and ran past the moment the driver noticed: c holds b, which
    # is not lost. Had c started only after the driver noticed, b would be.
    done = [
        Run("a", "A", 2, 0.0, 1.0),
        Run("b", "A", 2, 1.0, 2.0),
        Run("c", "C", 1, 2.05, 4.0),
    ]
    exp, _ = oracle(done, [Death("A", 2.0, 2.1)], [died(3.0, "A")])
    assert exp.lost == [set()]
    assert exp.completions == {"a": 1, "b": 1, "c": 1}

    late = [*done[:2], Run("c", "C", 1, 3.5, 5.0)]
    exp, _ = oracle(late, [Death("A", 2.0, 2.1)], [died(3.0, "A")])
    assert exp.lost == [{"b"}]
    assert exp.recompute == [{"a", "b"}]
