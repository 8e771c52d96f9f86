"""Checkpoints: the policy on the state machine alone, the store, and real computes on
Ray (a driver SIGKILLed and rerun, a corrupt checkpoint, a read-only store)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_state import finish, make, releases, submits

from raydag.core.checkpoints import FOUND, WRITTEN, Checkpoints
from raydag.core.events import (
    Cancel,
    Checkpoint,
    CheckpointFailed,
    CheckpointIgnored,
    CheckpointsOff,
    CheckpointWritten,
    DropCheckpoints,
    Recover,
    RemoveCheckpoints,
    ResultsLost,
    Submit,
    TaskErred,
    TaskFinished,
)

ON = Checkpoints(enabled=True, min_cost=60.0, keep=False, max_size=None, resume=True)
CHAIN = {"a": set(), "b": {"a"}, "c": {"b"}, "d": {"c"}}


def instructions(out: list, cls: type) -> list:
    return [i for i in out if isinstance(i, cls)]


def run_chain(s, seconds: dict) -> dict:
    """Run the chain ``a -> b -> c -> d`` to ``d``'s submission; each step's out."""
    outs = {}
    (sub,) = submits(s.start())
    for k in "abc":
        assert sub.keys == (k,), sub
        outs[k] = finish(s, sub, seconds.get(k, 1.0))
        (sub,) = submits(outs[k])
    outs["d-submit"] = sub
    return outs


def capped_run(graph: dict, outputs: list, max_size: int) -> tuple:
    """A state under ``max_size`` of checkpoints, started, and ``done(key, seconds,
    nbytes)``: finish ``key``'s copy (one key a group), check the state, return the out."""
    s = make(graph, outputs, checkpoints=dataclasses.replace(ON, max_size=max_size))
    subs = {sub.keys[0]: sub for sub in submits(s.start())}

    def done(key, seconds, nbytes):
        out = s.handle(TaskFinished(subs[key].copy, {key: seconds}, nbytes))
        s.validate_state()
        subs.update({sub.keys[0]: sub for sub in submits(out)})
        return out

    return s, done


# ---- the policy, on the state machine alone ----------------------------------------


def test_settings_defaults_are_the_yaml_and_from_config_reads_dask_config():
    import dask

    from raydag import config

    defaults = Checkpoints()
    assert defaults == Checkpoints.from_config()
    assert not defaults.enabled and defaults.store is None  # auto, and no store
    assert defaults.min_cost == config.default_seconds("checkpoint.min-cost")
    assert defaults.max_size == 50 * 2**30 and defaults.keep is False and defaults.resume
    with dask.config.set({"raydag.checkpoint.store": "/somewhere"}):
        assert Checkpoints.from_config().enabled  # auto: on with a store
    with dask.config.set({"raydag.checkpoint.enabled": True, "raydag.checkpoint.max-size": None}):
        on = Checkpoints.from_config()
        assert on.enabled and on.store is None and on.max_size is None


def test_a_result_is_written_once_its_lineage_cost_reaches_min_cost():
    s = make(CHAIN, ["d"], checkpoints=ON)
    outs = run_chain(s, {"a": 50.0, "b": 20.0, "c": 1.0})
    assert instructions(outs["a"], Checkpoint) == []  # 50 s behind it
    assert instructions(outs["b"], Checkpoint) == [Checkpoint("b")]  # 20 + 50 s
    # c: 1 s of its own, and b is checkpointed: 1 s behind it, not written
    assert instructions(outs["c"], Checkpoint) == []
    assert s.tasks["c"].behind == 1.0
    s.handle(CheckpointWritten("b", 100))
    assert s.tasks["b"].durable == WRITTEN
    s.validate_state()


def _fan_in(n: int) -> dict:
    return {**{f"x{i}": set() for i in range(n)}, "m": {f"x{i}" for i in range(n)}}


def test_the_exposure_a_driver_death_would_redo_stays_within_min_cost_on_every_cpu():
    """The worked example: 4 CPUs, min-cost 60 s, ten 40-s inputs of one merge (none
    worth writing by itself). Six in memory expose 240 s, the budget; from the seventh
    on, the largest exposed value is written, so a dead driver's rerun redoes 240
    task-seconds (60 s on the 4 CPUs), not 400."""
    s = make(_fan_in(10), ["m"], checkpoints=ON, capacity=4)
    assert s.checkpointer.budget() == 240.0
    subs = submits(s.start())
    written, order = [], []
    for _ in range(10):
        sub = subs.pop(0)
        order += sub.keys
        out = finish(s, sub, 40.0)
        subs += submits(out)
        written += [c.key for c in instructions(out, Checkpoint)]
        assert bool(written) == (len(order) > 6)
        assert s.checkpointer.exposure <= 240.0
    assert written == order[:4]  # 400 - 240 s: four; the largest first, ties the earliest
    assert s.checkpointer.exposure == 240.0
    (merge,) = subs
    finish(s, merge, 1.0)  # the inputs released: nothing exposed but the output
    assert set(s.checkpointer.exposed) <= {"m"}


def test_the_exposure_follows_releases_losses_and_more_cpus():
    deps = _fan_in(6)
    # 8 CPUs: 480 s allowed; six 40-s inputs never reach it
    s = make(deps, ["m"], checkpoints=ON, capacity=8)
    subs = submits(s.start())
    for sub in subs:
        assert not instructions(finish(s, sub, 40.0), Checkpoint)
    assert s.checkpointer.exposure == 240.0
    s.handle(ResultsLost(("x0",), "gone"))  # a lost value is no longer exposed
    s.validate_state()
    assert "x0" not in s.checkpointer.exposed and s.checkpointer.exposure == 200.0
    # per value (min-cost 0 on one CPU): every result is written, nothing exposed
    s = make(deps, ["m"], checkpoints=dataclasses.replace(ON, min_cost=0.0), capacity=1)
    (sub,) = submits(s.start())
    assert instructions(finish(s, sub, 40.0), Checkpoint) == [Checkpoint(sub.keys[0])]
    assert not s.checkpointer.exposed
    # forbidden values are never written, nor counted: the others are written as before
    s = make(deps, ["m"], checkpoints=ON, capacity=1, checkpoint_marks={"x0": False, "x1": False})
    out, written = s.start(), []
    for _ in range(6):
        out = finish(s, submits(out)[0], 40.0)
        written += [c.key for c in instructions(out, Checkpoint)]
    assert len(written) == 3 and not {"x0", "x1"} & set(written)
    assert not {"x0", "x1"} & set(s.checkpointer.exposed) and s.checkpointer.exposure == 40.0


def test_annotations_and_categories_force_or_forbid_a_write():
    marks = {"a": True, "b": False}
    s = make(CHAIN, ["d"], checkpoints=ON, checkpoint_marks=marks)
    outs = run_chain(s, {"a": 0.1, "b": 500.0, "c": 0.1})
    assert instructions(outs["a"], Checkpoint) == [Checkpoint("a")]  # forced, though cheap
    assert instructions(outs["b"], Checkpoint) == []  # forbidden, though long
    cats = dataclasses.replace(ON, categories=frozenset({"c"}))
    s = make(CHAIN, ["d"], checkpoints=cats)
    outs = run_chain(s, {})
    assert [
        i.key for o in outs.values() if isinstance(o, list) for i in o if isinstance(i, Checkpoint)
    ] == ["c"]


def test_checkpoints_off_by_default_and_capped_by_size():
    s = make(CHAIN, ["d"])
    outs = run_chain(s, {"a": 1e6})
    assert not any(instructions(o, Checkpoint) for o in outs.values() if isinstance(o, list))
    capped = dataclasses.replace(ON, max_size=10, min_cost=0.0)  # each value is 8 bytes
    s = make(CHAIN, ["d"], checkpoints=capped)
    outs = run_chain(s, {})
    written = [
        i.key for o in outs.values() if isinstance(o, list) for i in instructions(o, Checkpoint)
    ]
    assert written == ["a"]


def test_a_dearer_value_displaces_the_checkpoints_that_protect_least_per_byte():
    """The module's worked example: 300 MB of room; two 150-MB loads of 60 s are written.
    ``h``, an hour on a third load (60 MB), takes the room of one load (0.4 s a MB against
    its 61); ``x``, 100 s in 300 MB, would need both the other load and ``h`` (3,660 s
    together): it is not written, and nothing is displaced for it."""
    mb = 2**20
    graph = {"l0": set(), "l1": set(), "l2": set(), "x": set(), "h": {"l2"}}
    graph["m"] = {"l0", "l1", "h", "x"}
    s, done = capped_run(graph, ["m"], 300 * mb)

    for k in ("l0", "l1"):
        assert instructions(done(k, 60.0, 150 * mb), Checkpoint) == [Checkpoint(k)]
        s.handle(CheckpointWritten(k, 150 * mb))
    assert instructions(done("l2", 30.0, 150 * mb), Checkpoint) == []  # 30 s: not worth it
    out = done("h", 3600.0, 60 * mb)
    assert instructions(out, RemoveCheckpoints) == [RemoveCheckpoints(("l0",))]
    assert instructions(out, Checkpoint) == [Checkpoint("h")]
    assert s.tasks["l0"].durable is None and s.tasks["l1"].durable == WRITTEN
    s.handle(CheckpointWritten("h", 60 * mb))
    out = done("x", 100.0, 300 * mb)
    assert instructions(out, Checkpoint) == instructions(out, RemoveCheckpoints) == []
    assert s.tasks["l1"].durable == s.tasks["h"].durable == WRITTEN
    s.validate_state()


def test_a_displaced_checkpoint_gives_its_lineage_back_to_the_values_made_from_it():
    """The simulated 280 x 12 cluster's draw 7, small: ``c`` (65 s) reads ``f0`` (5 s),
    made from ``s0``, whose checkpoint spares ``l0`` and ``s0`` (150 s). The store is
    full and ``c`` is refused room (the cheapest checkpoint per byte, ``s0``, protects
    more than ``c`` would).
    ``h`` (an hour) then displaces ``s0``: a loss of ``c`` would now rerun 220 s, so
    ``c`` is offered again and written in the room left, and its loss reads it back.
    Before, ``c`` stayed at 70 s, never written, and its node's loss ran its chain again."""
    mb = 2**20
    graph = {"q0": set(), "q1": set(), "l0": set(), "s0": {"l0"}, "f0": {"s0"}, "c": {"f0"}}
    graph.update(x=set(), h={"x"}, m={"q0", "q1", "c", "h"})
    s, done = capped_run(graph, ["m"], 300 * mb)

    for k in ("q0", "q1"):  # 2 s a MB
        assert instructions(done(k, 200.0, 100 * mb), Checkpoint) == [Checkpoint(k)]
        s.handle(CheckpointWritten(k, 100 * mb))
    assert instructions(done("l0", 50.0, mb), Checkpoint) == []  # 50 s: not worth it
    assert instructions(done("s0", 100.0, 100 * mb), Checkpoint) == [Checkpoint("s0")]
    s.handle(CheckpointWritten("s0", 100 * mb))  # 1.5 s a MB; the store is full
    assert instructions(done("f0", 5.0, mb), Checkpoint) == []
    assert instructions(done("c", 65.0, 10 * mb), Checkpoint) == []  # no room
    assert s.tasks["c"].behind == 70.0
    done("x", 10.0, mb)
    out = done("h", 3600.0, 60 * mb)
    assert instructions(out, RemoveCheckpoints) == [RemoveCheckpoints(("s0",))]
    assert instructions(out, Checkpoint) == [Checkpoint("h"), Checkpoint("c")]
    assert s.tasks["c"].behind == 220.0  # its own 70 s, and s0's lineage again
    s.handle(CheckpointWritten("c", 10 * mb))
    out = s.handle(ResultsLost(("c",), "gone"))
    (wave,) = instructions(out, Recover)
    assert set(wave.recompute) == {"c"}  # read back: l0 and s0 do not run again
    s.validate_state()


@pytest.mark.parametrize("keep", [False, True])
def test_a_checkpoint_whose_readers_are_all_written_goes_and_frees_its_room(keep):
    """min-cost 0, room for two 8-byte values. Once ``b`` is written, ``a``'s checkpoint
    protects nothing (every lineage walk stops at ``b``): it goes, and ``c`` fits.
    Checkpoints to be kept stay (a later compute may share ``a``): ``c`` does not fit."""
    capped = dataclasses.replace(ON, max_size=16, min_cost=0.0, keep=keep)
    s = make(CHAIN, ["d"], checkpoints=capped)
    (sub,) = submits(s.start())
    written = []
    for k in "abc":
        out = finish(s, sub, 1.0)
        (sub,) = submits(out)
        if instructions(out, Checkpoint):
            out = s.handle(CheckpointWritten(k, 8))
            written.append(k)
        s.validate_state()
        gone = [k for i in instructions(out, RemoveCheckpoints) for k in i.keys]
        if k == "b":
            assert gone == ([] if keep else ["a"])
    assert written == (["a", "b"] if keep else ["a", "b", "c"])
    assert s.tasks["a"].durable == (WRITTEN if keep else None)
    # a loss of c reads b back, not a (a's checkpoint is gone: the walk stops at b)
    if not keep:
        out = s.handle(ResultsLost(("c",), "gone"))
        (wave,) = instructions(out, Recover)
        assert set(wave.recompute) == {"c"}  # c itself was written: read back
        s.validate_state()


def test_a_lost_value_with_a_checkpoint_is_read_back_its_lineage_not_walked():
    s = make(CHAIN, ["d"], checkpoints=ON)
    run_chain(s, {"a": 50.0, "b": 20.0, "c": 1.0})
    s.handle(CheckpointWritten("b", 100))
    assert s.tasks["a"].state == s.tasks["b"].state == "released"
    out = s.handle(ResultsLost(("c",), "gone"))
    s.validate_state()
    (wave,) = instructions(out, Recover)
    assert wave.lost == ("c",) and set(wave.recompute) == {"b", "c"}  # not a
    (read,) = submits(out)
    assert read.keys == ("b",) and read.restore == ("b",) and read.inputs == ()
    out = finish(s, read, 0.01)
    assert instructions(out, Checkpoint) == []  # read back: already durable
    (sub,) = submits(out)
    assert sub.keys == ("c",) and sub.restore == ()
    assert s.categories["b"].count == 1  # the read's runtime is not b's


def test_resume_starts_from_the_checkpoints_found():
    s = make(CHAIN, ["d"], checkpoints=ON, checkpointed={"b"})
    (sub,) = submits(s.start())
    s.validate_state()
    assert sub.keys == ("b",) and sub.restore == ("b",) and sub.inputs == ()
    assert s.tasks["a"].state == "released" and s.tasks["b"].durable == FOUND
    out = finish(s, sub)
    assert [x.keys for x in submits(out)] == [("c",)]
    (sub,) = submits(out)
    (sub,) = submits(finish(s, sub))
    out = finish(s, sub)  # d: done
    assert s.done
    assert instructions(out, DropCheckpoints) == [DropCheckpoints(("b",))]
    kept = make(CHAIN, ["d"], checkpoints=dataclasses.replace(ON, keep=True), checkpointed="b")
    subs = submits(kept.start())
    while subs:
        out = finish(kept, subs[0])
        assert instructions(out, DropCheckpoints) == []
        subs = submits(out)
    assert kept.done
    no_resume = make(
        CHAIN, ["d"], checkpoints=dataclasses.replace(ON, resume=False), checkpointed="b"
    )
    assert [x.keys for x in submits(no_resume.start())] == [("a",)]


def test_a_resumes_frontier_of_reads_is_submitted_at_once_not_a_slot_at_a_time():
    """Six loads, six procs, one total; the six procs found. On 2 slots with cheap tasks
    at a quarter of one, the six reads are all handed to Ray at the start; their loads
    are never submitted."""
    deps = {f"load-{i}": set() for i in range(6)}
    deps.update({f"proc-{i}": {f"load-{i}"} for i in range(6)})
    deps["total"] = {f"proc-{i}" for i in range(6)}
    found = {f"proc-{i}" for i in range(6)}
    s = make(deps, ["total"], checkpoints=ON, checkpointed=found, capacity=2, cheap_cost=0.25)
    subs = submits(s.start())
    s.validate_state()
    assert {k for sub in subs for k in sub.restore} == found
    assert all(sub.keys == sub.restore for sub in subs)  # nothing else: no load runs
    # without checkpoints, the loads go a slot at a time (their runtime unknown)
    s = make(deps, ["total"], capacity=2, cheap_cost=0.25)
    assert len(submits(s.start())) == 2


def test_an_unreadable_checkpoint_is_ignored_and_its_lineage_recomputed():
    s = make(CHAIN, ["d"], checkpoints=ON, checkpointed={"c"})
    (read,) = submits(s.start())
    assert read.restore == ("c",)
    out = s.handle(TaskErred(read.copy, "c", RuntimeError("does not match its hash")))
    s.validate_state()
    (ignored,) = instructions(out, CheckpointIgnored)
    assert ignored.key == "c" and "hash" in ignored.reason
    (wave,) = instructions(out, Recover)
    assert set(wave.recompute) == {"a", "b", "c"}
    order = []
    subs = submits(out)
    while subs:
        assert all(not x.restore for x in subs)
        order += [x.keys for x in subs]
        subs = submits(finish(s, subs[0]))
    assert order == [("a",), ("b",), ("c",), ("d",)] and s.done


def _first_written(graph: dict) -> tuple:
    """A state writing every result: its first checkpoint asked for, the next submit."""
    always = dataclasses.replace(ON, min_cost=0.0)
    s = make(graph, ["d"], checkpoints=always)
    (sub,) = submits(s.start())
    out = finish(s, sub)
    assert instructions(out, Checkpoint) == [Checkpoint("a")]
    (sub,) = submits(out)
    return s, sub


def test_a_failed_write_turns_checkpoints_off_once():
    s, sub = _first_written(CHAIN)
    out = s.handle(CheckpointFailed("a", PermissionError("read-only file system")))
    (off,) = instructions(out, CheckpointsOff)
    assert "read-only" in off.reason and s.tasks["a"].durable is None
    rest = []
    subs = [sub]
    while subs:
        out = finish(s, subs[0])
        rest += out
        subs = submits(out)
    assert instructions(rest, Checkpoint) == [] and s.done
    assert instructions(s.handle(CheckpointFailed("b", OSError("full"))), CheckpointsOff) == []
    assert releases(rest) >= {"c"}


def test_a_write_lost_with_its_node_leaves_checkpoints_on():
    """A write whose worker or node died says nothing of the store: that key is not
    durable, and the next results are still written."""
    s, sub = _first_written(CHAIN)
    out = s.handle(CheckpointFailed("a", RuntimeError("node died"), lost=True))
    assert instructions(out, CheckpointsOff) == [] and s.tasks["a"].durable is None
    out = finish(s, sub)
    assert instructions(out, Checkpoint) == [Checkpoint("b")]  # still on
    s.validate_state()


# ---- the store ----------------------------------------------------------------------


def test_store_round_trips_numpy_pandas_arrow_whole_or_not_at_all(tmp_path):
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    from raydag.runtime.checkpoints import CheckpointError, CheckpointStore

    store = CheckpointStore(str(tmp_path / "store"))
    store.open()
    values = {
        "np": np.arange(100_000, dtype="f8").reshape(100, 1000),
        "pd": pd.DataFrame({"x": np.arange(1000), "y": np.linspace(0, 1, 1000)}),
        "pa": pa.table({"z": pa.array(np.arange(1000))}),
        "plain": {"a": [1, 2, 3], "b": "text"},
    }
    for name, v in values.items():
        n = store.write(name, v, {"key": name})
        assert n >= (v.nbytes if name == "np" else 0)
    np.testing.assert_array_equal(store.read("np"), values["np"])
    assert store.read("np").flags.writeable and store.read("np").ctypes.data % 64 == 0
    pd.testing.assert_frame_equal(store.read("pd"), values["pd"])
    assert store.read("pa").equals(values["pa"])
    assert store.read("plain") == values["plain"]
    assert set(store.listing()) == set(values)
    data = tmp_path / "store" / "np.data"
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="hash"):
        store.read("np")
    data.write_bytes(bytes(raw[:-10]))
    with pytest.raises(CheckpointError, match="bytes of data"):
        store.read("np")
    (tmp_path / "store" / "pd.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest"):
        store.read("pd")
    assert store.remove(["np", "pd", "pa", "plain"]) == 7
    assert store.listing() == {}


def test_store_discards_superseded_checkpoints_whole_and_keeps_the_rest(tmp_path):
    from raydag.runtime.checkpoints import CheckpointError, CheckpointStore

    store = CheckpointStore(str(tmp_path / "store"))
    store.open()
    for name in ("a", "b", "c"):
        store.write(name, [name] * 10, {"key": name})
    assert store.discard(["a", "b", "gone"]) == 4  # manifest and data of each; none of gone
    assert set(store.listing()) == {"c"} and store.read("c") == ["c"] * 10
    with pytest.raises(CheckpointError):
        store.read("a")


def test_names_change_with_the_task_its_inputs_and_raydag_version(monkeypatch):
    from checkpoint_job import graph
    from dask._task_spec import convert_legacy_graph

    from raydag.runtime import checkpoints

    def names(dsk):
        tasks = convert_legacy_graph(dsk)
        return checkpoints.names(tasks, {k: t.dependencies for k, t in tasks.items()})

    base = names(graph("log"))
    assert base == names(graph("log"))  # the same graph: the same names
    other = graph("log")
    other["load-0"] = (other["load-0"][0], "log", 0.25, "#load-0")  # another load-0
    changed = {k for k, n in names(other).items() if n != base[k]}
    assert changed == {"load-0", "proc-0", "pair-0", "total"}  # it and what is below it
    monkeypatch.setattr(checkpoints, "version", lambda: "9.9")
    assert not set(names(graph("log")).values()) & set(base.values())


def test_stale_and_foreign_checkpoints_are_never_used_silently(tmp_path, caplog, monkeypatch):
    """Found: only this graph's names. A key's file under another fingerprint (another
    task, another raydag version) is not found but counted and warned of; a manifest of
    another raydag version under the very name is refused when read."""
    import json

    from checkpoint_job import graph
    from dask._task_spec import convert_legacy_graph

    from raydag.runtime import checkpoints

    def names():
        tasks = convert_legacy_graph(graph("log", n=2))
        return checkpoints.names(tasks, {k: t.dependencies for k, t in tasks.items()})

    url = str(tmp_path / "store")
    store = checkpoints.CheckpointStore(url)
    store.open()
    ours = names()
    store.write(ours["load-0"], 1, {"key": "load-0"})
    store.write(f"{checkpoints.key_token('proc-0')}-0123456789abcdef0123", 2, {"key": "proc-0"})
    store.write("ffffffffffffffffffff-0123456789abcdef0123", 3, {"key": "another graph's"})
    with caplog.at_level("WARNING", logger="raydag"):
        _, found, partial = checkpoints.open_store(url, ours, resume=True)
    assert found == {"load-0"} and partial == []
    (warned,) = [r.getMessage() for r in caplog.records]
    assert "ignoring 1 checkpoint files" in warned and "stale" in warned
    caplog.clear()
    monkeypatch.setattr(checkpoints, "version", lambda: "9.9")  # another raydag version
    with caplog.at_level("WARNING", logger="raydag"):
        _, found, _ = checkpoints.open_store(url, names(), resume=True)
    assert found == set()
    assert any("ignoring 2 checkpoint files" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    manifest = tmp_path / "store" / f"{ours['load-0']}.json"
    meta = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**meta, "raydag": "0.0.1"}))
    with pytest.raises(checkpoints.CheckpointError, match="written by raydag 0.0.1"):
        store.read(ours["load-0"])


def test_a_full_store_fails_the_write_and_leaves_nothing_behind(tmp_path):
    """A store that fills up mid-write (ENOSPC): the write raises (the Ray layer reports
    it, and checkpoints go off), and no partial file stays."""
    import errno

    import numpy as np
    from fsspec.implementations.local import LocalFileSystem

    from raydag.runtime.checkpoints import CheckpointStore

    class Full(LocalFileSystem):
        def _open(self, path, mode="rb", **kwargs):
            f = super()._open(path, mode, **kwargs)
            if "w" in mode:
                room = [1000]
                write = f.write

                def limited(data):
                    room[0] -= memoryview(data).nbytes
                    if room[0] < 0:
                        raise OSError(errno.ENOSPC, "No space left on device")
                    return write(data)

                f.write = limited
            return f

    store = CheckpointStore(str(tmp_path / "store"))
    store.open()
    store._fs = Full()
    with pytest.raises(OSError, match="No space left"):
        store.write("aaaa-1111", np.zeros(10_000), {"key": "x"})
    assert list((tmp_path / "store").iterdir()) == []
    assert store.write("bbbb-2222", 1, {"key": "small"}) > 0  # what fits is written


def test_the_command_lists_and_cleans_a_store(tmp_path, capsys):
    import time

    from raydag.cli import main
    from raydag.runtime.checkpoints import CheckpointStore

    url = str(tmp_path / "store")
    store = CheckpointStore(url)
    store.open()
    store.write("aaaa-1111", list(range(10)), {"key": "('x', 0)"})
    store.write("bbbb-2222", "old", {"key": "'y'"})
    (tmp_path / "store" / "cccc-3333.data").write_bytes(b"partial")  # no manifest
    (tmp_path / "store" / "dddd-4444.data.tmp-1234").write_bytes(b"killed mid-write")
    assert main(["checkpoints", "list", url]) == 0
    listed = capsys.readouterr().out
    assert "('x', 0)" in listed and "no manifest" in listed and "4 checkpoints" in listed
    time.sleep(0.2)
    store.write("aaaa-1111", list(range(10)), {"key": "('x', 0)"})  # fresh again
    assert main(["checkpoints", "clean", url, "--older-than", "0.1s"]) == 0
    assert "removed 3 checkpoints" in capsys.readouterr().out
    assert set(store.listing()) == {"aaaa-1111"}
    assert main(["checkpoints", "clean", url]) == 0
    assert store.listing() == {}


# ---- computes on Ray ----------------------------------------------------------------


def _job_env() -> dict:
    import os

    import ray

    env = dict(os.environ)
    env["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    env["PYTHONPATH"] = os.pathsep.join([root, here, env.get("PYTHONPATH", "")])
    return env


def _manifests(store) -> int:
    return len(list(store.glob("*.json"))) if store.exists() else 0


@pytest.mark.cluster
@pytest.mark.slow
def test_a_killed_node_loses_a_checkpointed_and_an_uncheckpointed_input(clusters, tmp_path):
    """Two one-CPU nodes: ``ck`` (its category checkpointed) and ``plain`` (not; it reads
    ``ck``) run on one node, while ``gate`` holds the other; ``final`` reads all three.
    That node is killed once ``ck`` is written: ``ck`` is read back (it runs once, by the
    tasks' own log), ``plain`` is recomputed from it, the result is the same."""
    import os

    import dask
    import numpy as np
    from chaos import (
        Background,
        MiB,
        T,
        assert_stores_empty,
        build,
        completions,
        ensure_nodes,
        kill,
        runs,
        wait_until,
    )
    from checkpoint_job import gate
    from dask._task_spec import Task

    import raydag

    c = clusters.get()
    ensure_nodes(c, 2)
    log, opened, store = str(tmp_path / "runs.log"), str(tmp_path / "open"), tmp_path / "store"
    spec = {
        "ck": T(0.3, MiB, 1.0),
        "plain": T(0.3, MiB, 2.0, ("ck",)),
        "final": T(0.05, 8, 0.0, ("ck", "plain", "gate")),
    }
    dsk = build({k: t for k, t in spec.items() if k != "final"}, log)
    dsk["gate"] = Task("gate", gate, opened)
    dsk["final"] = build({"final": spec["final"]}, log)["final"]
    conf = {
        "raydag.checkpoint.store": str(store),
        "raydag.checkpoint.categories": ["ck"],
        "raydag.checkpoint.min-cost": "1 hour",  # only ck's category is written
        "raydag.fusion.enabled": False,  # ck and plain each a Ray task of their own
    }
    with dask.config.set(conf):
        bg = Background(lambda: raydag.ray_get(dsk, "final"))
        wait_until(lambda: _manifests(store) == 1, "ck's checkpoint", bg)
        wait_until(lambda: completions(log)["plain"] == 1, "plain", bg)
        where = {r.label: r.node for r in runs(log)}
        assert where["ck"] == where["plain"], where  # the gate holds the other CPU
        kill(c, where["ck"])
        open(opened, "w").close()
        result = bg.result(120)
    np.testing.assert_array_equal(result, np.full(1, 1.0 + (2.0 + 1.0)))
    done = completions(log)
    assert done == {"ck": 1, "plain": 2, "final": 1}, done  # ck read back, not rerun
    assert not os.listdir(store)  # a finished compute's checkpoints are removed
    del result
    assert_stores_empty()


@pytest.mark.cluster
def test_driver_killed_mid_compute_reruns_from_its_checkpoints(clusters, tmp_path):
    """On the module's multi-node cluster, after the node-death test: the objects a
    SIGKILLed driver owned stay in the store of the cluster it ran on, which would fail
    a later test's check of an empty store (the shared embedded Ray is not touched)."""
    from chaos import ensure_nodes

    c = clusters.get()  # its workers import checkpoint_job from tests/ (chaos.Clusters)
    ensure_nodes(c, 2)
    _driver_killed_then_rerun(tmp_path)


def _driver_killed_then_rerun(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import dask
    import numpy as np
    from checkpoint_job import graph, ran

    store, log = tmp_path / "store", str(tmp_path / "ran.log")
    cmd = [sys.executable, "-c", "import checkpoint_job; checkpoint_job.main()"]
    # the total also waits for the file ``hold``, made only for the rerun: the first run
    # cannot end before the test sees what it waits for, however late the writes land
    hold = tmp_path / "hold"
    args = [str(store), log, str(tmp_path / "out.npy"), "0s", "8", "0.5", str(hold)]
    driver = subprocess.Popen(cmd + args, env=_job_env(), stderr=subprocess.PIPE)
    # Killed once half the tasks ran and some checkpoints are in the store. Not "once N
    # are": a checkpoint whose readers are all checkpointed is removed mid-compute, so
    # the store holds about the frontier (a few of this graph's), not all written so far.
    tasks = len(graph(log, hold=str(hold)))
    try:
        deadline = time.monotonic() + 120
        while (
            (len(ran(log)) < tasks // 2 or _manifests(store) < 2)
            and driver.poll() is None
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert driver.poll() is None, driver.stderr.read().decode()[-3000:]
    finally:
        if driver.poll() is None:
            os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    first = ran(log)
    written = _manifests(store)
    assert written >= 2 and "total" not in first, (written, first)
    os.remove(log)
    hold.touch()
    rerun = subprocess.run(cmd + args, env=_job_env(), capture_output=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr.decode()[-3000:]
    second = ran(log)
    expect = dask.get(graph(str(tmp_path / "sync.log")), "total")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), expect)
    # only what was not checkpointed ran again; at least the written ones did not
    assert len(second) <= tasks - 1 - written, (first, second)  # "hold" logs nothing
    assert list(store.iterdir()) == []  # a finished compute's checkpoints are removed


def _compute(store, log, **settings):
    import dask
    from checkpoint_job import graph

    import raydag

    # no fusion: a value fused away never leaves its Ray task, so it is never written
    conf = {
        "raydag.checkpoint.store": str(store),
        "raydag.checkpoint.min-cost": "0s",
        "raydag.fusion.enabled": False,
    }
    conf.update({f"raydag.checkpoint.{k}": v for k, v in settings.items()})
    with dask.config.set(conf):
        return raydag.get(graph(log, n=4, seconds=0.05), "total")


@pytest.mark.ray_only  # the dask version plays no part: once, in the tests session
def test_a_nodes_writes_all_go_to_its_writer_in_a_process_of_its_own(ray_cluster, tmp_path):
    """Every write on a known node is a call of the node's writer, the first too (held
    by Ray while the writer starts); a value of no known node is written by a task; the
    writer's process is of its own runtime env (never a worker kept for the tasks); each
    value is written whole; closing ends the writer."""
    import os
    import time

    import numpy as np
    import ray

    from raydag.core.events import CheckpointWritten
    from raydag.runtime.checkpoints import Checkpointing, CheckpointStore

    store = CheckpointStore(str(tmp_path / "store"))
    store.open()
    keys = [f"v{i}" for i in range(4)]
    ck = Checkpointing(store, {k: f"name-{k}" for k in keys})
    node = ray.get_runtime_context().get_node_id()
    refs = {k: ray.put(np.full(1000, i)) for i, k in enumerate(keys)}
    calls = [ck.write(k, refs[k], node) for k in keys[:3]]
    assert all(ck._by.get(w) == node for w in calls)  # the writer's calls, from the first
    assert list(ck.writers) == [node]
    task = ck.write("v3", refs["v3"], None)
    assert task not in ck._by
    ended = [ck.ended(w) for w in (*calls, task)]
    assert all(isinstance(e, CheckpointWritten) for e in ended), ended
    for i, k in enumerate(keys):
        np.testing.assert_array_equal(store.read(f"name-{k}"), np.full(1000, i))
    writer = ck.writers[node]
    marker = ray.get(
        writer.__ray_call__.remote(lambda _: os.environ.get("RAYDAG_CHECKPOINT_WRITER"))
    )
    assert marker == "1"
    ck.close()
    assert not ck.writers
    deadline = time.monotonic() + 60
    with pytest.raises(ray.exceptions.RayActorError):  # ended (calls run concurrently)
        while time.monotonic() < deadline:
            ray.get(writer.__ray_call__.remote(lambda _: None), timeout=60)
            time.sleep(0.1)


@pytest.mark.ray_only  # the dask version plays no part: once, in the tests session
def test_superseded_checkpoints_go_by_a_writer_and_a_finished_compute_leaves_none(
    ray_cluster, tmp_path
):
    import time

    import numpy as np
    import ray
    from checkpoint_job import ran

    from raydag.runtime.checkpoints import Checkpointing, CheckpointStore

    store = CheckpointStore(str(tmp_path / "store"))
    store.open()
    keys = ["v0", "v1", "v2"]
    ck = Checkpointing(store, {k: f"name-{k}" for k in keys})
    node = ray.get_runtime_context().get_node_id()
    first = ck.write("v0", ray.put(np.zeros(10)), node)
    deadline = time.monotonic() + 60
    while ck._writer(node) is None:
        assert time.monotonic() < deadline, "the writer never came up"
        time.sleep(0.05)
    refs = [first, *(ck.write(k, ray.put(np.zeros(10)), node) for k in keys[1:])]
    assert all(type(ck.ended(r)).__name__ == "CheckpointWritten" for r in refs)
    ck.discard(["v0", "v1"])
    assert len(ck.discards) == 1  # by the writer, not on the driver's loop
    ck.settle()
    assert set(store.listing()) == {"name-v2"} and not ck.discards
    ck.close()
    # a whole compute (min-cost 0: every value written, each superseded by its readers')
    log = str(tmp_path / "ran.log")
    expect = _compute(tmp_path / "whole", log)
    assert len(ran(log)) == 11 and _manifests(tmp_path / "whole") == 0
    np.testing.assert_array_equal(_compute(tmp_path / "whole", log), expect)


def test_a_corrupt_or_partial_checkpoint_is_ignored_with_a_warning(
    ray_cluster, tmp_path, caplog, assert_store_empty
):
    import numpy as np
    from checkpoint_job import ran

    store, log = tmp_path / "store", str(tmp_path / "ran.log")
    expect = _compute(store, log, keep=True)
    assert len(ran(log)) == 11 and _manifests(store) == 11  # kept
    again = _compute(store, log, keep=True)
    np.testing.assert_array_equal(again, expect)
    assert len(ran(log)) == 11  # the outputs read back: nothing ran
    # proc-0's data corrupted; pair-0's manifest gone (a partial write), total's too
    data = next(p for p in store.glob("*.data") if '"proc-0"' in _key_of(p))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    next(p for p in store.glob("*.json") if '"pair-0"' in _key_of(p)).unlink()
    next(p for p in store.glob("*.json") if '"total"' in _key_of(p)).unlink()
    os_remove_log(log)
    with caplog.at_level("WARNING", logger="raydag"):
        result = _compute(store, log)
    np.testing.assert_array_equal(result, expect)
    warned = [r.getMessage() for r in caplog.records if "checkpoint" in r.getMessage()]
    assert any("proc-0" in m and "hash" in m for m in warned), warned
    assert any("2 partial checkpoints" in m for m in warned), warned
    # total and pair-0 recomputed; proc-0 too, from load-0 (read back)
    assert sorted(ran(log)) == ["pair-0", "proc-0", "total"], ran(log)
    assert list(store.iterdir()) == []  # removed at the end, the corrupt one too
    assert_store_empty()


def _key_of(path) -> str:
    import json

    manifest = path.with_suffix(".json")
    if manifest.exists():
        return json.loads(manifest.read_text())["key"].replace("'", '"')
    return ""


def os_remove_log(log: str) -> None:
    import os

    if os.path.exists(log):
        os.remove(log)


def test_a_read_only_store_is_reported_once_and_the_compute_finishes(
    ray_cluster, tmp_path, caplog, assert_store_empty
):
    import shutil
    import subprocess

    from checkpoint_job import ran

    if shutil.which("chattr") is None:
        pytest.skip("no chattr here to make a directory read-only")
    store, log = tmp_path / "store", str(tmp_path / "ran.log")
    store.mkdir()
    expect = _compute(tmp_path / "other", str(tmp_path / "other.log"))
    if subprocess.run(["chattr", "+i", str(store)]).returncode != 0:
        pytest.skip("cannot make a directory read-only here")
    try:
        with caplog.at_level("WARNING", logger="raydag"):
            result = _compute(store, log)
    finally:
        subprocess.run(["chattr", "-i", str(store)])
    import numpy as np

    np.testing.assert_array_equal(result, expect)
    # told once, at the start (the driver's probe write), not by each write
    off = [r for r in caplog.records if "checkpoint" in r.getMessage()]
    assert len(off) == 1, [r.getMessage() for r in caplog.records]
    assert "cannot use the checkpoint store" in off[0].getMessage()
    assert "Permission" in off[0].getMessage() or "permitted" in off[0].getMessage()
    assert len(ran(log)) == 11 and list(store.iterdir()) == []
    assert_store_empty()
    # a store that cannot even be made: one warning, no checkpoints
    blocker = tmp_path / "file"
    blocker.write_text("")
    caplog.clear()
    with caplog.at_level("WARNING", logger="raydag"):
        np.testing.assert_array_equal(_compute(blocker / "store", log), expect)
    assert [r.getMessage() for r in caplog.records if "checkpoint store" in r.getMessage()]


@pytest.mark.core_only
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_runs_with_checkpoints_losses_and_bad_reads(data):
    """Random graphs, random finishing order, checkpoints written or failing, values
    lost, reads back failing, a size cap (checkpoints superseded and displaced); every
    state valid, every output made, nothing read back that was not written whole, or
    that was removed since."""
    n = data.draw(st.integers(2, 14))
    deps = {
        f"k{i}": {f"k{j}" for j in data.draw(st.sets(st.integers(0, i - 1), max_size=3))}
        if i
        else set()
        for i in range(n)
    }
    dependents = {k for v in deps.values() for k in v}
    outputs = [k for k in deps if k not in dependents]
    found = data.draw(st.sets(st.sampled_from(sorted(deps))))
    settings_ = dataclasses.replace(
        ON,
        min_cost=data.draw(st.sampled_from([0.0, 1.5, 1e9])),
        max_size=data.draw(st.sampled_from([None, 24, 64])),
    )
    s = make(deps, outputs, checkpoints=settings_, checkpointed=found, capacity=2)
    durable: set = set(found)  # what the store holds whole, as the model knows it
    writing: set = set()
    inflight: dict = {}

    def apply(out: list) -> None:
        for i in out:
            if isinstance(i, Submit):
                assert set(i.restore) <= durable, (i, durable)
                for k in i.restore:
                    assert not s.tasks[k].dependencies
                    event("a value read back")
                inflight[i.copy] = i
            elif isinstance(i, Checkpoint):
                assert i.key not in writing
                writing.add(i.key)
            elif isinstance(i, Cancel):
                inflight.pop(i.copy, None)
            elif isinstance(i, RemoveCheckpoints):
                assert not {k for sub in inflight.values() for k in sub.restore} & set(i.keys)
                assert not writing & set(i.keys), (i, writing)
                durable.difference_update(i.keys)
                event("checkpoints removed")
        s.validate_state()

    apply(s.start())
    for _ in range(400):
        if s.done:
            break
        moves = ["finish"] * 4 + ["lose"] + (["write"] if writing else [])
        move = data.draw(st.sampled_from(moves))
        if move == "write":
            k = data.draw(st.sampled_from(sorted(writing)))
            writing.discard(k)
            if data.draw(st.integers(0, 5)):
                durable.add(k)
                apply(s.handle(CheckpointWritten(k, 8)))
            else:
                apply(s.handle(CheckpointFailed(k, OSError("full"))))
            continue
        if move == "lose":
            held = sorted(k for k, ts in s.tasks.items() if ts.state == "memory")
            if held:
                apply(s.handle(ResultsLost((data.draw(st.sampled_from(held)),), "gone")))
            continue
        assert inflight, "nothing in flight but not done"
        copy = data.draw(st.sampled_from(sorted(inflight)))
        sub = inflight.pop(copy)
        if sub.restore and data.draw(st.integers(0, 4)) == 0:  # a bad checkpoint
            bad = sub.restore[0]
            durable.discard(bad)
            event("a read back failed")
            apply(s.handle(TaskErred(copy, bad, RuntimeError("corrupt"))))
            continue
        seconds = data.draw(st.sampled_from([0.5, 1.0, 4.0]))
        nbytes = data.draw(st.sampled_from([8, 16]))
        apply(s.handle(TaskFinished(copy, {k: seconds for k in sub.keys}, nbytes)))
    assert s.done and not s.stopped
    assert all(s.tasks[k].state == "memory" for k in outputs)


def test_a_node_death_reads_back_the_checkpointed_and_recomputes_the_rest():
    from raydag.core.events import NodeDied

    deps = {"a1": set(), "a2": set(), "b1": {"a1"}, "b2": {"a2"}, "c": {"b1", "b2"}}
    marks = {"b1": True}
    s = make(deps, ["c"], checkpoints=ON, checkpoint_marks=marks, nodes={"n1": 2, "n2": 2})
    subs = submits(s.start())
    while subs:
        sub = subs.pop(0)
        if sub.keys == ("c",):
            break
        node = "n1" if sub.root.startswith("b") else "n2"
        out = s.handle(TaskFinished(sub.copy, {k: 1.0 for k in sub.keys}, 8, node))
        s.validate_state()
        for i in instructions(out, Checkpoint):
            s.handle(CheckpointWritten(i.key, 8))
        subs += submits(out)
    assert s.tasks["b1"].durable == WRITTEN and s.tasks["b2"].durable is None
    assert s.tasks["a1"].state == s.tasks["a2"].state == "released"
    out = s.handle(NodeDied("n1", "killed"))
    s.validate_state()
    (wave,) = instructions(out, Recover)
    assert set(wave.lost) == {"b1", "b2"} and set(wave.recompute) == {"b1", "b2", "a2"}
    by_key = {x.keys: x for x in submits(out)}
    assert by_key[("b1",)].restore == ("b1",) and ("a2",) in by_key and ("a1",) not in by_key
