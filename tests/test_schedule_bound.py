"""The #17 benchmark's lower bound (tests/schedule_bound.py) on cases checked by hand,
and against every assignment on small random ones."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_bound import blind, bound, fractional, optimum, speeds_of

pytestmark = pytest.mark.core_only  # the benchmark's bound: no Ray, no dask


def test_two_equal_nodes():
    # 3 + 3 on one node, 2 + 2 + 2 on the other: 6, which the fractional bound reaches
    span, assign = optimum([3, 3, 2, 2, 2], [1, 1])
    assert span == 6 and sorted(assign) == [0, 0, 1, 1, 1]
    # three 2-s tasks on two nodes: one node runs two, 4 (fractional: 3)
    assert optimum([2, 2, 2], [1, 1])[0] == 4 and fractional([2, 2, 2], [1, 1]) == 3


def test_a_slow_node():
    # a 2x node: two 1-s tasks on the fast node (2), one on the slow (2): 2
    assert optimum([1, 1, 1], [1, 0.5])[0] == 2
    # a 5x node: a 1-s task there takes 5; all three on the fast node take 3
    span, assign = optimum([1, 1, 1], speeds_of(2, 5.0))
    assert span == 3 and assign == [1, 1, 1]


def test_a_hung_node_gets_nothing():
    span, assign = optimum([1, 1, 1], speeds_of(3, math.inf))
    assert span == 2 and 0 not in assign


def test_bound_adds_the_final_task_and_says_how():
    b = bound([2, 2, 2], [1, 1], final=0.1)
    assert b.exact and b.seconds == 4.1 and b.fractional == 3.1
    assert b.how.startswith("exact 4.00 (work/speed per node: 4.00/1, 2.00/1) + 0.1 = 4.10")


def test_bound_falls_back_to_fractional_when_the_search_is_too_big():
    b = bound([2, 2, 2, 1.5, 1.5], [1, 1], final=0.1, limit=0)
    assert not b.exact and b.seconds == b.fractional == 4.6
    assert "exact search too big" in b.how


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=6),
    speeds=st.lists(st.sampled_from([0.0, 0.05, 0.2, 0.5, 1.0]), min_size=1, max_size=3),
)
def test_optimum_is_the_best_of_every_assignment(lengths, speeds):
    speeds = [1.0, *speeds]
    best = min(
        max(
            sum(x for x, j in zip(lengths, a, strict=True) if j == k) / s if s else 0.0
            for k, s in enumerate(speeds)
        )
        for a in itertools.product(*(range(len(speeds)),) * len(lengths))
        if all(speeds[j] > 0 for j in a)
    )
    span, assign = optimum(lengths, speeds)
    assert math.isclose(span, best, rel_tol=1e-9)
    assert all(speeds[j] > 0 for j in assign)
    assert span >= fractional(lengths, speeds) - 1e-9


def test_blind_scheduling_by_hand():
    # two 1-s tasks and a 2-s one on two nodes: the 2-s one first or second ends at 2,
    # last at 3 (a third of the orders)
    spans = blind([1, 1, 2], [1, 1], final=0.0, orders=3000)
    assert set(spans) == {2.0, 3.0} and 0.28 < spans.count(3.0) / len(spans) < 0.38
    # a 5x node is avoided (as raydag's slow-node rule does), a 2x one used, a hung one never
    assert set(blind([1, 1, 1], speeds_of(2, 5.0), final=0.1)) == {3.1}
    assert set(blind([1, 1, 1], speeds_of(2, math.inf), final=0.1)) == {3.1}
    assert set(blind([1, 1, 1], [1.0, 0.5], final=0.0)) == {2.0}


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=7),
    speeds=st.lists(st.sampled_from([0.0, 0.2, 0.5, 1.0]), min_size=0, max_size=4),
)
def test_no_blind_order_beats_the_clairvoyant_bound(lengths, speeds):
    speeds = [1.0, *speeds]
    spans = blind(lengths, speeds, final=0.1, orders=50)
    assert spans == sorted(spans) and len(spans) == 50
    assert spans[0] >= bound(lengths, speeds, final=0.1).seconds - 1e-9
