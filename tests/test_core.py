"""The core's own decisions, no Ray: what a node's death lost, copies, transitions, parts.

``tests/test_state.py`` runs the whole state machine on random graphs against a model;
this file checks the decisions that moved into it from the Ray layer (#16): which node is
dead and what it lost, a fresh copy id per attempt, the transition table, and each
policy part's settings coming from raydag.yaml alone.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raydag import config
from raydag.core import bundles
from raydag.core.events import (
    Cancel,
    CpusChanged,
    Fail,
    InputLost,
    NodeDied,
    NodeTakenDead,
    Recover,
    Release,
    Submit,
    TaskErred,
    TaskFinished,
    TaskStarted,
)
from raydag.core.fusion import Fusion
from raydag.core.placement import Placement
from raydag.core.records import MEMORY, PROCESSING, RELEASED, WAITING
from raydag.core.recovery import Recovery
from raydag.core.speculation import Speculation
from raydag.core.state import TRANSITIONS, InvalidTransition, State


def submits(out: list) -> list[Submit]:
    return [i for i in out if isinstance(i, Submit)]


def waves(out: list) -> list[Recover]:
    return [i for i in out if isinstance(i, Recover)]


def make(deps: dict, outputs, **kw) -> State:
    prio = {k: i for i, k in enumerate(deps)}
    return State(deps, prio, set(outputs), capacity=kw.pop("capacity", 8), **kw)


def run_to(s: State, out: list, where: dict, nbytes: int = 1 << 20, until=()) -> list:
    """Finish every submitted copy on ``where[root]`` (default n0) until nothing is
    submitted or the next one would run a key of ``until``; returns what is in flight."""
    pending = submits(out)
    held = []
    while pending:
        sub = pending.pop(0)
        if set(sub.keys) & set(until):
            held.append(sub)
            continue
        node = where.get(sub.root, "n0")
        out = s.handle(TaskFinished(sub.copy, dict.fromkeys(sub.keys, 0.1), nbytes, node))
        s.validate_state()
        pending += submits(out)
    return held


# ---- a node's death, decided in the state machine -----------------------------------


def test_a_node_death_loses_what_it_held_and_its_released_lineage_in_one_wave():
    #  a -> b -> c -> out ; d -> out   (c made on n2, d on n1)
    deps = {"a": set(), "b": {"a"}, "c": {"b"}, "d": set(), "out": {"c", "d"}}
    s = make(deps, {"out"}, nodes={"n0": 1, "n1": 1, "n2": 1})
    held = run_to(s, s.start(), {"c": "n2", "d": "n1"}, until={"out"})
    assert [h.root for h in held] == ["out"] and s.tasks["b"].state == RELEASED
    # ``out`` was sent, not started: it holds nothing
    out = s.handle(NodeDied("n2"))
    s.validate_state()
    (rec,) = waves(out)
    # c, and its released lineage b and a; d (on n1) is kept
    assert rec.lost == ("c",) and set(rec.recompute) == {"c", "b", "a"}
    assert Cancel(held[0].copy) in out  # its input is gone: it waits again
    assert s.tasks["out"].state == WAITING and not s.is_alive("n2")
    assert s.tasks["d"].state == MEMORY and not s.held_on("n2")


def test_a_running_reader_holds_its_inputs_and_one_that_reads_a_lost_value_does_not():
    # x, y made on n1; g given (its node unknown to raydag); r1 reads x, r2 reads y and
    # g, r3 reads g. r1 and r2 run on n3.
    deps = {"g": set(), "x": set(), "y": set(), "r1": {"x"}, "r2": {"y", "g"}, "r3": {"g"}}
    s = make(deps, {"r1", "r2", "r3"}, available={"g"}, nodes={"n1": 1, "n3": 1})
    held = run_to(s, s.start(), {"x": "n1", "y": "n1"}, until={"r1", "r2", "r3"})
    r1, r2, r3 = sorted(held, key=lambda h: h.root)
    s.handle(TaskStarted(r1.copy, "n3", 1.0))
    s.handle(TaskStarted(r2.copy, "n3", 1.0))
    assert waves(s.handle(NodeDied("n1"))) == []  # x and y held by their running readers
    # Ray says g is gone: r2 cannot finish, so it holds y no more; r1 still holds x
    out = s.handle(InputLost(r3.copy, ("g",), "input of 'r3' lost"))
    s.validate_state()
    (rec,) = waves(out)
    assert set(rec.lost) == {"g", "y"} and s.tasks["x"].state == MEMORY
    assert Cancel(r2.copy) in out and r1.copy in s.copies


def test_values_ray_returns_inline_survive_their_node():
    deps = {"small": set(), "big": set(), "out": {"small", "big"}}
    s = make(deps, {"out"}, nodes={"n1": 1}, inline_bytes=100 * 1024, inline_total=10 << 20)
    out = s.start()
    for sub in submits(out):
        size = 10 if sub.root == "small" else 1 << 20
        out = s.handle(TaskFinished(sub.copy, {sub.root: 0.1}, size, "n1"))
    out = s.handle(NodeDied("n1"))
    (rec,) = waves(out)
    assert rec.lost == ("big",) and s.tasks["small"].state == MEMORY


def test_ray_losing_a_value_takes_its_node_for_dead_and_one_wave_takes_all_it_held():
    deps = {"a": set(), "b": set(), "c": {"a"}, "d": {"b"}}
    s = make(deps, {"c", "d"}, nodes={"n1": 1, "n2": 1})
    held = run_to(s, s.start(), {"a": "n1", "b": "n1"}, until={"c", "d"})
    c = next(h for h in held if h.root == "c")
    out = s.handle(InputLost(c.copy, ("a",), "input of 'c' lost"))
    s.validate_state()
    assert NodeTakenDead("n1", "Ray lost a value it held (input of 'c' lost)") in out
    (rec,) = waves(out)
    assert set(rec.lost) == {"a", "b"}  # b went with its node, in the same wave
    # the cluster reports the death later: nothing more is lost
    assert waves(s.handle(NodeDied("n1"))) == []


def test_a_result_reported_after_its_nodes_death_is_lost_at_once():
    deps = {"a": set(), "b": {"a"}}
    s = make(deps, {"b"}, nodes={"n1": 1, "n2": 1})
    (a,) = submits(s.start())
    s.handle(NodeDied("n1"))
    out = s.handle(TaskFinished(a.copy, {"a": 0.1}, 1 << 20, "n1"))
    s.validate_state()
    (rec,) = waves(out)
    assert rec.lost == ("a",) and [x.root for x in submits(out)] == ["a"]


def test_given_values_on_a_node_dead_before_the_compute_are_recomputed_at_start():
    deps = {"g": set(), "h": {"g"}}
    s = make(deps, {"h"}, available={"g"}, given_nodes={"g": "gone"}, nodes={"n1": 1})
    out = s.start()
    (rec,) = waves(out)
    assert rec.lost == ("g",) and [x.root for x in submits(out)] == ["g"]


@pytest.mark.parametrize("ray_first", [False, True])
def test_given_values_of_an_earlier_ray_session_are_recomputed_at_start(ray_first):
    """``gone``: the Ray layer's word that given values went with an earlier Ray session.
    Those the compute reads are recomputed from their lineage, ray-first or not; one
    nothing reads (``g2``) is not."""
    deps = {"a": set(), "g": {"a"}, "g2": {"a"}, "h": {"g"}}
    s = make(
        deps,
        {"h"},
        available={"g", "g2"},
        gone={"g", "g2"},
        nodes={"n1": 1},
        given_nodes={"g": "n1", "g2": "n1"},
        recovery=Recovery(ray_first=ray_first),
    )
    out = s.start()
    s.validate_state()
    (rec,) = waves(out)
    assert rec.lost == ("g",) and set(rec.recompute) == {"g", "a"}
    assert [x.root for x in submits(out)] == ["a"]
    run_to(s, out, {})
    s.validate_state()
    assert s.done and s.tasks["g2"].state == RELEASED and s.tasks["h"].state == MEMORY
    assert s.gone == {"g2"}  # g was made again: lost later, it is recomputed as any value


def test_a_gone_given_value_is_never_held_again_when_a_recomputation_reads_it():
    """``b`` (gone) is read by nothing but the given ``c``; when ``c``'s node dies, its
    recomputation reads ``b``, which must be recomputed too, not taken as held."""
    deps = {"a": set(), "b": {"a"}, "c": {"b"}, "h": {"c"}}
    s = make(
        deps,
        {"h"},
        available={"b", "c"},
        gone={"b"},
        nodes={"n1": 1, "n2": 1},
        given_nodes={"b": "n1", "c": "n2"},
    )
    out = s.start()
    assert waves(out) == [] and [x.root for x in submits(out)] == ["h"]  # b: not read
    (h,) = submits(out)
    out = s.handle(NodeDied("n2"))
    s.validate_state()
    (rec,) = waves(out)
    assert rec.lost == ("c",) and set(rec.recompute) == {"a", "b", "c"}


def test_a_given_value_of_an_earlier_ray_session_without_lineage_fails_naming_it():
    deps = {"g": set(), "h": {"g"}}
    s = make(deps, {"h"}, available={"g"}, fixed={"g"}, gone={"g"}, nodes={"n1": 1})
    out = s.start()
    (fail,) = [i for i in out if isinstance(i, Fail)]
    assert fail.key == "g" and "'g'" in str(fail.error) and "earlier Ray session" in str(fail.error)
    assert submits(out) == [] and s.done


def test_ray_first_leaves_lost_values_to_ray_until_a_reader_fails():
    deps = {"a": set(), "b": {"a"}}
    s = make(deps, {"b"}, nodes={"n1": 1, "n2": 1}, recovery=Recovery(ray_first=True))
    (b,) = run_to(s, s.start(), {"a": "n1"}, until={"b"})
    assert waves(s.handle(NodeDied("n1"))) == []
    out = s.handle(InputLost(b.copy, ("a",), "Ray gave up"))
    (rec,) = waves(out)
    assert rec.lost == ("a",)


@pytest.mark.core_only
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_deaths_lose_what_the_rule_says(data):
    """Random fan-ins, values on random nodes, random running readers, a random death:
    the wave's lost values are exactly those the documented rule gives, computed here
    independently."""
    n_src = data.draw(st.integers(1, 8))
    n_out = data.draw(st.integers(1, 6))
    srcs = [f"s{i}" for i in range(n_src)]
    deps: dict = {s: set() for s in srcs}
    for j in range(n_out):
        deps[f"o{j}"] = set(data.draw(st.lists(st.sampled_from(srcs), min_size=1, max_size=4)))
    read = {s for j in range(n_out) for s in deps[f"o{j}"]}
    deps = {k: v for k, v in deps.items() if k in read or k.startswith("o")}
    nodes = ["n0", "n1", "n2"]
    where = {k: data.draw(st.sampled_from(nodes)) for k in deps}
    s = make(deps, {k for k in deps if k.startswith("o")}, nodes=dict.fromkeys(nodes, 1))
    held = run_to(s, s.start(), where, until={k for k in deps if k.startswith("o")})
    running = {}
    for h in held:
        if data.draw(st.booleans()):
            node = data.draw(st.sampled_from(nodes))
            s.handle(TaskStarted(h.copy, node, 1.0))
            running[h.copy] = (node, set(h.inputs))
    dead = data.draw(st.sampled_from(nodes))
    # the rule: values on the dead node, less those read by a copy running elsewhere that
    # reads no lost value, until nothing changes
    on_dead = {k for k, n in where.items() if n == dead and s.tasks[k].state == MEMORY}
    readers = [inputs for node, inputs in running.values() if node != dead]
    lost = {k for k in on_dead if not any(k in r for r in readers)}
    while True:
        staying = [r for r in readers if not r & lost]
        more = {k for k in on_dead - lost if not any(k in r for r in staying)}
        if not more:
            break
        lost |= more
    out = s.handle(NodeDied(dead))
    s.validate_state()
    got = {k for w in waves(out) for k in w.lost}
    assert got == lost, (got, lost, running, where, dead)


# ---- copies, transitions, the one door ------------------------------------------


def test_every_attempt_is_a_fresh_copy_and_a_late_report_of_an_old_one_changes_nothing():
    s = make({"a": set()}, {"a"}, default_retries=2)
    (first,) = submits(s.start())
    (again,) = submits(s.handle(TaskErred(first.copy, "a", OSError(), worker_died=True)))
    assert again.group == first.group and again.copy != first.copy and again.attempt == 1
    (third,) = submits(s.handle(TaskErred(again.copy, "a", OSError(), node_died=True)))
    assert third.copy not in (first.copy, again.copy) and third.attempt == 1
    # the first copy's result arrives after all: not ours
    assert s.handle(TaskFinished(first.copy, {"a": 1.0}, 8, "n0")) == []
    assert s.tasks["a"].state == PROCESSING
    assert s.handle(TaskFinished(third.copy, {"a": 1.0}, 8, "n0")) == []
    assert s.done and s.tasks["a"].state == MEMORY


def test_transitions_only_along_the_table():
    s = make({"a": set(), "b": {"a"}}, {"b"})
    s.start()
    ts = s.tasks["b"]
    assert (ts.state, MEMORY) not in TRANSITIONS
    with pytest.raises(InvalidTransition, match="'b': waiting -> memory"):
        s.transition(ts, MEMORY)
    assert all(a != b for a, b in TRANSITIONS)


def test_unknown_event_is_refused():
    s = make({"a": set()}, {"a"})
    s.start()
    with pytest.raises(TypeError, match="Unknown event"):
        s.handle(Release("a"))  # an instruction, not an event


def test_cpus_decide_the_slots():
    s = make({f"k{i}": set() for i in range(6)}, {f"k{i}" for i in range(6)}, capacity=1,
             in_flight_per_cpu=2.0)  # fmt: skip
    assert len(submits(s.start())) == 1
    assert len(submits(s.handle(CpusChanged(2)))) == 3 and s.capacity == 4


# ---- policy parts: settings from raydag.yaml alone -----------------------------------


@pytest.mark.parametrize(
    "cls, section",
    [(Fusion, "fusion"), (Speculation, "speculation"), (Placement, "placement"),
     (Recovery, "recovery")],
)  # fmt: skip
def test_settings_defaults_are_the_yaml_and_from_config_reads_dask_config(cls, section):
    defaults = cls()
    for f in dataclasses.fields(cls):
        key = f"{section}.{f.name.replace('_', '-')}"
        if f.name == "min_output":
            expect = 100 * 1024
        elif key in ("fusion.max-task-duration", "fusion.max-group-duration",
                     "speculation.long-task", "speculation.min-runtime",
                     "speculation.min-gain", "speculation.block-slow-node"):  # fmt: skip
            expect = config.default_seconds(key)
        else:
            expect = config.default(key)
        assert getattr(defaults, f.name) == expect, key
    assert cls.from_config() == defaults  # nothing set: the same
    import dask

    with dask.config.set({f"raydag.{section}.enabled": False} if section != "recovery"
                         else {"raydag.recovery.ray-first": True}):  # fmt: skip
        assert cls.from_config() != defaults


def test_bad_placement_settings_are_refused():
    with pytest.raises(ValueError, match="high-water"):
        Placement(high_water=1.5)
    with pytest.raises(ValueError, match="balance"):
        Placement(balance=-1)


def test_bundle_finders_are_asked_through_the_registry():
    def finder(tasks, dependents):
        return {k: sorted(dependents[k]) for k in tasks if str(k).startswith("m")}

    bundles.register(finder)
    try:
        deps = {"m": set(), "p0": {"m"}, "p1": {"m"}, "r": {"p0", "p1"}}
        dependents = {k: {d for d, v in deps.items() if k in v} for k in deps}
        found = bundles.find(deps, dependents)
        assert found["m"] == ("p0", "p1")
        s = make(deps, {"r"}, bundles=found)
        (sub,) = submits(s.start())
        assert sub.keys == ("m", "p0", "p1") and sub.returns == ("p0", "p1")
    finally:
        bundles._finders.remove(finder)


# ---- the provisional order (#19) -------------------------------------------------------


def _two_sums() -> dict:
    """``s0 = c0 + c1``, ``s1 = c2 + c3``, each ``c`` the end of a chain ``r -> p -> c``."""
    from operator import add

    dsk: dict = {}
    for i in range(4):
        dsk[f"r{i}"] = i
        dsk[f"p{i}"] = (abs, f"r{i}")
        dsk[f"c{i}"] = (abs, f"p{i}")
    dsk["s0"] = (add, "c0", "c1")
    dsk["s1"] = (add, "c2", "c3")
    return dsk


def test_depth_first_makes_each_subtree_whole_before_the_next():
    from dask.order import order

    from raydag.core.graph import Graph, depth_first

    g = Graph.from_dask(_two_sums(), ["s0", "s1"], order_later_above=0)
    assert not g.ordered
    p = g.priorities
    assert p == depth_first(g.dependencies, ["s0", "s1"])
    assert sorted(p.values()) == list(range(len(g)))
    assert all(p[d] < p[k] for k, deps in g.dependencies.items() for d in deps)
    for i in range(4):  # a chain's three tasks run one after the other
        assert p[f"p{i}"] == p[f"r{i}"] + 1 and p[f"c{i}"] == p[f"p{i}"] + 1
    for s, (a, b) in (("s0", ("c0", "c1")), ("s1", ("c2", "c3"))):
        # a sum right after its last input: held at once, one chain's end and one chain
        assert p[s] == max(p[a], p[b]) + 1
    whole = Graph.from_dask(_two_sums(), ["s0", "s1"])
    assert whole.ordered
    later = g.order()  # dask.order's, of each part alone, the part begun first first
    assert sorted(later.values()) == list(range(len(g)))
    part = [f"{x}{i}" for i in (0, 1) for x in "rpc"] + ["s0"]  # s0's, begun first
    assert max(later[k] for k in part) < min(v for k, v in later.items() if k not in part)
    first = Graph.from_dask({k: _two_sums()[k] for k in part}, ["s0"])
    assert sorted(part, key=later.__getitem__) == sorted(part, key=first.priorities.__getitem__)
    one = Graph.from_dask(_two_sums() | {"t": (sum, ["s0", "s1"])}, ["t"], order_later_above=0)
    assert one.order() == order(one.tasks)  # one part: dask.order's of the whole graph
    assert Graph.from_dask(_two_sums(), ["s0", "s1"], order_later_above=len(g)).ordered
