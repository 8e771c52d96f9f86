"""What a dask scheduler owes its caller besides results: errors, callbacks, arguments, Ctrl-C."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import warnings
from operator import add

import dask
import numpy as np
import pytest
import ray
from dask._task_spec import Task, TaskRef
from dask.callbacks import Callback
from dask.diagnostics import Profiler, ProgressBar

import raydag
from raydag.api import IgnoredArgumentsWarning

pytestmark = pytest.mark.usefixtures("ray_cluster")


def inc(x):
    return x + 1


def big(i):
    """A value above Ray's inlining threshold, so that it goes through the object store."""
    return np.full(50_000, i, dtype="float64")


# ---- exceptions ---------------------------------------------------------------------


def user_function_that_fails(x):
    raise ValueError("boom")


class CustomError(Exception):
    """Defined here: the driver must get this very class back, not a wrapper."""

    def __init__(self, msg, code=0):
        super().__init__(msg, code)
        self.code = code


def raise_custom(x):
    raise CustomError("custom", code=7)


class UnpicklableError(Exception):
    """Carries a lock, so pickling it fails on the worker."""

    def __init__(self, msg):
        super().__init__(msg)
        self.lock = threading.Lock()


def raise_unpicklable(x):
    raise UnpicklableError("cannot ship me")


class NeedsTwoArgsError(Exception):
    """Pickles fine but cannot be rebuilt: ``args`` holds one of the two required arguments."""

    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def raise_needs_two_args(x):
    raise NeedsTwoArgsError("a", "b")


def _graph_with_failure(fail):
    """Big inputs, one failing task among working ones."""
    d = dask.delayed
    inputs = [d(big)(i) for i in range(4)]
    ok = d(sum)([d(np.sum)(a) for a in inputs])
    bad = d(fail)(inputs[0])
    return ok, bad


def test_user_exception_type_and_traceback(assert_store_empty):
    ok, bad = _graph_with_failure(user_function_that_fails)
    with pytest.raises(ValueError, match="^boom$") as info:
        dask.compute(ok, bad, scheduler=raydag.ray_get)
    assert type(info.value) is ValueError
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "user_function_that_fails" in frames, frames
    del info
    assert_store_empty()


def test_custom_exception_round_trips(assert_store_empty):
    ok, bad = _graph_with_failure(raise_custom)
    with pytest.raises(CustomError) as info:
        dask.compute(ok, bad, scheduler=raydag.ray_get)
    assert type(info.value) is CustomError
    assert info.value.code == 7
    assert "raise_custom" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    del info
    assert_store_empty()


@pytest.mark.parametrize(
    "fail, name",
    [(raise_unpicklable, "UnpicklableError"), (raise_needs_two_args, "NeedsTwoArgsError")],
    ids=["pickling-fails", "unpickling-fails"],
)
def test_unshippable_exception_gives_a_clear_error(fail, name, assert_store_empty):
    """The error must still name the original exception and its message."""
    ok, bad = _graph_with_failure(fail)
    with pytest.raises(Exception) as info:  # noqa: B017  (the type is what we look at)
        dask.compute(ok, bad, scheduler=raydag.ray_get)
    text = str(info.value)
    assert name in text, text
    assert "cannot ship me" in text or "a/b" in text, text
    del info
    assert_store_empty()


MAIN_ERROR_SCRIPT = textwrap.dedent(
    """
    import dask, raydag

    class MainError(Exception):
        pass

    def fail(x):
        raise MainError(f"from main {x}")

    dask.config.set({"raydag.progress.enabled": False})
    try:
        dask.compute(dask.delayed(fail)(1, dask_key_name="fails"), scheduler=raydag.ray_get)
    except MainError as e:
        print("CAUGHT", type(e) is MainError, e, flush=True)
    except BaseException as e:
        print("NOT CAUGHT", type(e).__name__, e, flush=True)
    """
)


def _script(code: str, *args: str, timeout: float = 300) -> str:
    """Run ``code`` as ``__main__`` in a new process on the session's Ray; its output."""
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return done.stdout


def test_an_exception_class_of_main_is_caught_by_its_class():
    """A script's (or a notebook's) own exception class: the worker ships it by value,
    and the driver gets back its very class (it was "MainError: from main (the
    exception could not be pickled)", a RuntimeError)."""
    out = _script(MAIN_ERROR_SCRIPT)
    assert "CAUGHT True from main 1" in out, out


class TaskWarning(UserWarning):
    """Raised in a task: the driver must see this very category."""


def warns_then_returns(x):
    warnings.warn(f"look at {x}", TaskWarning, stacklevel=1)
    warnings.warn("deprecated", DeprecationWarning, stacklevel=1)
    return x + 1


def warns_then_fails(x):
    warnings.warn("before the failure", TaskWarning, stacklevel=1)
    raise ValueError("after the warning")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the driver's filter decides
@pytest.mark.parametrize("scheduler", ["sync", raydag.ray_get], ids=["sync", "raydag"])
def test_warnings_raised_in_tasks_are_warned_on_the_driver(scheduler, assert_store_empty):
    """As under dask's threads: ``pytest.warns`` (the driver's filters) sees a task's
    warnings, each once per task, with its category, text and place; also those
    raised before the task failed."""
    xs = [dask.delayed(warns_then_returns)(i, dask_key_name=f"w-{i}") for i in range(3)]
    with pytest.warns(TaskWarning) as seen:
        assert dask.compute(*xs, scheduler=scheduler) == (1, 2, 3)
    texts = sorted(str(w.message) for w in seen if w.category is TaskWarning)
    assert texts == ["look at 0", "look at 1", "look at 2"]
    mine = [w for w in seen if w.category is TaskWarning]
    assert all(w.filename == __file__ for w in mine), [w.filename for w in mine]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TaskWarning)  # a filter of the driver's applies
        with pytest.raises(TaskWarning):
            dask.compute(xs[0], scheduler=scheduler)
    with pytest.warns(TaskWarning, match="before the failure"), pytest.raises(ValueError):
        dask.compute(dask.delayed(warns_then_fails)(1), scheduler=scheduler)


def interrupt(marker):
    with open(marker, "a") as f:
        f.write("ran\n")
    raise KeyboardInterrupt("from the task")


def exit_3(marker):
    with open(marker, "a") as f:
        f.write("ran\n")
    sys.exit(3)


def _raised(scheduler, fn, marker):
    x = dask.delayed(fn)(str(marker), dask_key_name="leaves")
    try:
        dask.compute(x, scheduler=scheduler)
    except BaseException as e:  # KeyboardInterrupt and SystemExit are the point
        return e
    raise AssertionError(f"{fn.__name__} raised nothing under {scheduler}")


@pytest.mark.parametrize("fn", [interrupt, exit_3], ids=["KeyboardInterrupt", "SystemExit"])
def test_keyboard_interrupt_and_system_exit_in_a_task_as_dask_raises_them(
    fn, tmp_path, assert_store_empty
):
    """dask's sync and threads schedulers raise them as the task did. raydag did not:
    a ``TaskCancelledError`` naming no key, and ``SystemExit(3)`` retried three times
    as a worker crash, then a ``WorkerDiedError`` without the code."""
    expected = [_raised(s, fn, tmp_path / s) for s in ("sync", "threads")]
    got = _raised(raydag.ray_get, fn, tmp_path / "raydag")
    for e in expected:
        assert type(got) is type(e) and got.args == e.args, (got, e)
    if fn is exit_3:
        assert got.code == 3
    assert not isinstance(got, ray.exceptions.RayError)
    notes = "\n".join(getattr(got, "__notes__", ["'leaves'"]))  # notes: Python 3.11+
    assert "'leaves'" in notes, notes
    assert (tmp_path / "raydag").read_text() == "ran\n", "it ran more than once"
    assert raydag.last_run().meta["status"] == "failed"  # the task's, not a Ctrl-C
    del got
    assert_store_empty()


def nap_after_marking(marker, seconds):
    """Runs Python code all along: Ray's interrupt lands at once (a single long
    ``time.sleep`` would not see it until it returns). The marker says what would
    ignore the interrupt: the process's SIGINT handler, and the thread."""
    main = threading.current_thread() is threading.main_thread()
    with open(marker, "w") as f:
        f.write(f"pid {os.getpid()}, SIGINT {signal.getsignal(signal.SIGINT)!r}, main {main}")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
    return 1


@pytest.mark.ray_only
def test_ray_cancel_without_force_is_not_taken_for_the_tasks_keyboard_interrupt(tmp_path):
    """Ray cancels a running task (without force) with a KeyboardInterrupt in its thread:
    the worker passes that one on to Ray, which reports the task cancelled, where a
    task's own KeyboardInterrupt comes back as its error."""
    from raydag.runtime import cancel
    from raydag.runtime.worker import remote_group

    marker = tmp_path / "started"
    node = Task("napper", nap_after_marking, str(marker), 60)
    value_ref, meta_ref = remote_group.remote([node], (), None)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists(), "the task never started"
    t0 = time.monotonic()
    cancel([meta_ref], force=False)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        try:
            ray.get(meta_ref, timeout=30)
        except ray.exceptions.GetTimeoutError:  # say why: the worker, and the inbox
            from raydag.runtime.inbox import inbox

            try:
                ray.get(inbox().drain.remote(-1), timeout=10)
                box = "the inbox answers"
            except Exception as e:
                box = f"the inbox does not answer: {e!r}"
            pytest.fail(f"not cancelled in 30 s: {marker.read_text()}; {box}")
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(value_ref, timeout=5)
    assert time.monotonic() - t0 < 20


NEW_SESSION_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import dask, dask.array as da, numpy as np, ray, raydag
    from dask._task_spec import DataNode, Task, TaskRef

    log = sys.argv[1]

    def logged(block):
        if block.size:  # not map_blocks' meta inference
            with open(log, "a") as f:
                f.write("x\\n")
        return block * 2

    def runs():
        return open(log).read().count("x")

    dask.config.set({"raydag.progress.enabled": False})
    # chunks in the object store (1.6 MB) and inline ones (8 kB), returned to the driver
    big = da.ones(800_000, chunks=200_000).map_blocks(logged, dtype=float)
    small = da.ones(4_000, chunks=1_000).map_blocks(logged, dtype=float)
    (p, q) = raydag.persist(big, small)
    print("PERSISTED", runs(), flush=True)
    ray.shutdown()
    ray.init(address=os.environ["RAY_ADDRESS"])  # the same cluster: a new job
    get = raydag.ray_get
    sums = [float((p + 1).sum().compute(scheduler=get)), float(q.sum().compute(scheduler=get))]
    print("SUMS", *sums, runs(), flush=True)
    print("AGAIN", float(p.sum().compute(scheduler=get)), runs(), flush=True)  # healed

    (given,) = [v for v in dict(q.__dask_graph__()).values() if hasattr(v, "ref")][:1]
    ray.shutdown()
    ray.init(address=os.environ["RAY_ADDRESS"])
    dsk = {"given": DataNode("given", given), "out": Task("out", np.sum, TaskRef("given"))}
    try:  # a value given with no lineage: nothing can bring it back
        raydag.ray_get(dsk, "out")
    except Exception as e:
        print("NO LINEAGE", type(e).__name__, e, flush=True)
    """
)


@pytest.mark.ray_only  # the dask version plays no part: once, in the tests session
def test_persisted_results_of_an_earlier_ray_session_run_from_their_lineage(tmp_path):
    """After ``ray.shutdown()`` and a new ``ray.init()`` (here on the same cluster, as a
    new job) the persisted values are gone: a compute recomputes them from the lineage
    the collections carry (it failed in the submit: Ray's "owner is unknown"). Without
    a lineage the error names the key."""
    out = _script(NEW_SESSION_SCRIPT, str(tmp_path / "runs.txt"))
    assert "PERSISTED 8" in out, out
    assert "SUMS 2400000.0 8000.0 16" in out, out
    assert "AGAIN 1600000.0 16" in out, out
    assert "NO LINEAGE RuntimeError 'given' was given" in out and "earlier Ray session" in out, out


def _driver_refs() -> set[bytes]:
    return set(ray._private.worker.global_worker.core_worker.get_all_reference_counts())


@pytest.mark.parametrize(
    "fail", [user_function_that_fails, raise_needs_two_args], ids=["shipped", "rebuilt"]
)
def test_a_kept_error_keeps_no_ref(fail, assert_store_empty):
    """A caller may keep the error for good (a notebook keeps the last one): it must not
    keep the compute's refs, nor their objects, and no garbage collection may be needed."""
    before = _driver_refs()
    ok, bad = _graph_with_failure(fail)
    gc.disable()
    try:
        with pytest.raises(Exception) as info:  # noqa: B017  (the type is not the point)
            dask.compute(ok, bad, scheduler=raydag.ray_get)
        kept = info.value
        deadline = time.monotonic() + 5  # a cancelled task's refs go once it has ended
        while (left := _driver_refs() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"the driver still holds {len(left)} refs of the failed compute"
        assert_store_empty()
        assert kept.__traceback__ is not None
    finally:
        gc.enable()


def kill_my_worker_once(marker, x):
    """SIGKILL of its own worker process the first time (as the OOM killer does)."""
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def kill_my_worker(x):
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("always", [False, True], ids=["retried", "kept-error"])
def test_a_dead_worker_keeps_no_ref(always, tmp_path, assert_store_empty):
    """Ray raises a dead worker's error from a frame that holds it, with the task's refs:
    a cycle only garbage collection frees. Neither a retried task nor a kept error may
    keep the compute's refs or objects (the CI found it when a forced cancel killed a
    reused worker)."""
    d = dask.delayed
    inputs = [d(big)(i) for i in range(3)]
    marker = str(tmp_path / "marker")
    dead = d(kill_my_worker)(inputs[0]) if always else d(kill_my_worker_once)(marker, inputs[0])
    out = d(sum)([d(np.sum)(dead), *inputs[1:]])
    before = _driver_refs()
    gc.disable()
    try:
        with dask.config.set(
            {"raydag.retries": 0 if always else 1, "raydag.fusion.enabled": False}
        ):
            if always:
                with pytest.raises(raydag.WorkerDiedError) as info:
                    dask.compute(out, scheduler=raydag.ray_get)
                kept = info.value
            else:
                (got,) = dask.compute(out, scheduler=raydag.ray_get)
                assert got.shape == (50_000,)
                del got
        deadline = time.monotonic() + 3
        while (left := _driver_refs() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left, f"the driver still holds {len(left)} refs of the compute"
        assert_store_empty()
        if always:
            assert isinstance(kept.__cause__, ray.exceptions.WorkerCrashedError)
    finally:
        gc.enable()


def stubborn(seconds, value):
    """Goes on after a (non-forced) cancel, as code in C that never checks for signals would."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(left)
    return value


@pytest.mark.ray_only
def test_cancelled_task_refs_are_held_until_it_ends(assert_store_empty):
    """Ray can leave a cancelled task's value pinned in the store for good when the
    driver drops its refs before it ends: raydag holds them until then, without
    holding up the error."""
    from raydag.runtime.graveyard import graveyard as _graveyard

    d = dask.delayed
    # two worker processes up first: on a cold Ray the error waits for them, not the task
    dask.compute(d(sleep_then)(0.5, 1), d(sleep_then)(0.5, 2), scheduler=raydag.ray_get)
    slow = d(stubborn)(8, d(big)(1), dask_key_name="stubborn")
    bad = d(fail_after)(1, dask_key_name="bad")
    t0 = time.monotonic()
    # not forced: the task goes on, where a forced cancel would end it at once
    with (
        dask.config.set({"raydag.cancel.force": False}),
        pytest.raises(ValueError, match="failed while others run"),
    ):
        dask.compute(bad, slow, scheduler=raydag.ray_get)
    # 1 s and the start of two tasks; waiting would take the cancelled task's 8 s
    assert time.monotonic() - t0 < 6, "the error waited for the cancelled task"
    assert len(_graveyard) == 1, "the cancelled task's refs were dropped at once"
    deadline = time.monotonic() + 14
    while len(_graveyard) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not len(_graveyard), "the cancelled task's refs are held after it ended"
    assert_store_empty()


@pytest.mark.slow
@pytest.mark.ray_only
def test_cancels_never_abort_the_driver(assert_store_empty):
    """Ray 2.60 aborts a driver whose own ``ray.cancel`` meets the task's reply; raydag's
    cancels go by way of another process. 6,000 tiny tasks cancelled as they run and
    end: the driver lives (with ``ray.cancel`` it aborted in rounds 3 to 64 in 5 of 5
    runs here: ``tests/cancel_race.py --via ray``)."""
    script = os.path.join(os.path.dirname(__file__), "cancel_race.py")
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run(
        [sys.executable, script, "--via", "raydag", "--rounds", "100"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert "not pending" not in out, out[-3000:]
    assert done.returncode == 0, out[-3000:]
    survived = done.stdout.strip().splitlines()[-1]
    cancelled, finished = (int(w) for w in survived.split(":")[1].split() if w.isdigit())
    assert cancelled > 1000 and finished > 1000, survived  # the race needs both
    assert_store_empty()


WORKER_DEATH_SCRIPT = textwrap.dedent(
    """
    import gc, os, signal, sys, time
    from functools import partial
    import dask, numpy as np, raydag

    def die_once(marker):
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return np.zeros(1000)

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    marker = sys.argv[1]
    x = dask.delayed(partial(die_once, marker))(dask_key_name="die-once")
    (got,) = dask.compute(x, scheduler=raydag.ray_get)
    assert got.sum() == 0
    with dask.config.set({"raydag.retries": 1}):
        try:
            dask.compute(dask.delayed(die)(dask_key_name="die-always"), scheduler=raydag.ray_get)
        except raydag.WorkerDiedError:
            print("RAISED WorkerDiedError", flush=True)
    gc.collect()
    time.sleep(1.0)  # Ray reports an unread error when its ref goes, from a thread
    """
)


@pytest.mark.slow
@pytest.mark.ray_only
def test_worker_deaths_log_no_unhandled_errors(tmp_path):
    """A failed Ray task's value refs hold its error too. raydag reads them, or Ray logs an
    "Unhandled error" for each when it is dropped (this test failed on that before)."""
    script = tmp_path / "deaths.py"
    script.write_text(WORKER_DEATH_SCRIPT)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "marker")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0 and "RAISED WorkerDiedError" in out, out[-3000:]
    assert "lost its worker process" in out, out[-3000:]  # the deaths did happen
    assert "Unhandled error" not in out, out[-3000:]


def test_function_missing_on_workers_is_a_clear_error(tmp_path, monkeypatch, caplog):
    """A module only the driver can import: say so at once, not "worker died" after retries."""
    (tmp_path / "driver_only_module.py").write_text("def f(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the driver's path; workers never see it
    import driver_only_module

    caplog.set_level(logging.WARNING, logger="raydag")
    with pytest.raises(Exception, match="No module named 'driver_only_module'") as info:
        dask.compute(dask.delayed(driver_only_module.f)(1), scheduler=raydag.ray_get)
    assert "WorkerDied" not in type(info.value).__name__
    assert "lost its worker" not in caplog.text  # not retried as a crash


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def fail_after(seconds):
    time.sleep(seconds)
    raise ValueError("failed while others run")


def _busy(store_count) -> str:
    """What of ours still holds the store or a CPU ('' when nothing does)."""
    objects = store_count()
    free, total = ray.available_resources().get("CPU", 0), ray.cluster_resources()["CPU"]
    return " and ".join(
        [f"{objects} objects in the store"] * bool(objects)
        + [f"{free} of {total} CPUs free"] * (free != total)
    )


def _wait_until_idle(store_count, timeout) -> str:
    deadline = time.monotonic() + timeout
    while _busy(store_count) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _busy(store_count)


@pytest.mark.parametrize("force", [None, True], ids=["default-config", "cancel.force=true"])
def test_failure_cancels_work_in_flight(force, store_count, assert_store_empty, describe_leftovers):
    """A long task running beside the failing one must not hold up compute(), a CPU or the store."""
    d = dask.delayed
    nap = 20
    # On 2 CPUs (the 2 workers Ray prestarts) the sleeper and the failing task run at once.
    sleeper = d(sleep_then)(nap, big(1), dask_key_name="sleeper")
    bad = d(fail_after)(0.5, dask_key_name="bad")
    busy = _wait_until_idle(store_count, 10)
    assert not busy, f"not idle before the test: {busy}\n{describe_leftovers()}"
    config = {} if force is None else {"raydag.cancel.force": force}
    try:
        with dask.config.set(config):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="failed while others run"):
                dask.compute(bad, sleeper, scheduler=raydag.ray_get)
            elapsed = time.monotonic() - t0
        assert elapsed < nap / 2, f"compute() took {elapsed:.1f} s"

        # The sleeper was stopped: its pinned input is freed and its CPU is free again
        # long before the nap would have ended.
        assert_store_empty()
        busy = _wait_until_idle(store_count, 5)
        assert not busy, f"{busy}\n{describe_leftovers()}"
        got = dask.compute(*[d(sleep_then)(0.1, i) for i in range(4)], scheduler=raydag.ray_get)
        assert got == (0, 1, 2, 3)
        busy = _wait_until_idle(store_count, 5)
        assert not busy, f"after the next compute: {busy}\n{describe_leftovers()}"
    finally:
        _wait_until_idle(store_count, nap + 5)  # do not leak into later tests


# ---- dask callbacks -----------------------------------------------------------------


class Recorder(Callback):
    """Records every callback with a timestamp."""

    def __init__(self):
        super().__init__()
        self.events = []

    def _start(self, dsk):
        self.events.append(("start", time.monotonic(), None))

    def _start_state(self, dsk, state):
        assert {"waiting", "running", "finished", "dependencies", "dependents"} <= set(state)
        self.events.append(("start_state", time.monotonic(), None))

    def _pretask(self, key, dsk, state):
        self.events.append(("pretask", time.monotonic(), key))

    def _posttask(self, key, result, dsk, state, worker_id):
        self.events.append(("posttask", time.monotonic(), key))

    def _finish(self, dsk, state, errored):
        self.events.append(("finish", time.monotonic(), errored))

    def times(self, kind):
        return [t for k, t, _ in self.events if k == kind]

    def keys(self, kind):
        return [key for k, _, key in self.events if k == kind]


def _sleepy_graph(n=8, seconds=0.2):
    d = dask.delayed
    parts = [d(sleep_then)(seconds, i, dask_key_name=f"nap-{i}") for i in range(n)]
    return d(sum)(parts, dask_key_name="total")


def test_callbacks_fire_in_order_and_posttask_follows_the_work(assert_store_empty):
    rec = Recorder()
    with rec:
        assert dask.compute(_sleepy_graph(), scheduler=raydag.ray_get) == (sum(range(8)),)
    kinds = [k for k, _, _ in rec.events]
    assert kinds[:2] == ["start", "start_state"] and kinds[-1] == "finish"
    assert rec.events[-1][2] is False  # not errored
    task_keys = {f"nap-{i}" for i in range(8)} | {"total"}
    assert set(rec.keys("pretask")) == task_keys
    assert sorted(rec.keys("posttask")) == sorted(task_keys)
    for key in task_keys:
        pre = next(t for k, t, x in rec.events if k == "pretask" and x == key)
        post = next(t for k, t, x in rec.events if k == "posttask" and x == key)
        assert pre <= post

    start = rec.times("start_state")[0]
    naps = sorted(t for k, t, x in rec.events if k == "posttask" and x != "total")
    # 8 naps of 0.2 s on 2 CPUs take >= 0.8 s: the posttasks must spread over that,
    # not all arrive at submission time.
    assert naps[0] - start >= 0.15, "a posttask fired before its task could have run"
    assert naps[-1] - naps[0] >= 0.4, naps
    assert rec.times("posttask")[-1] <= rec.times("finish")[0]
    assert_store_empty()


def test_callbacks_finish_reports_errors():
    rec = Recorder()
    with rec, pytest.raises(ValueError):
        dask.compute(dask.delayed(user_function_that_fails)(1), scheduler=raydag.ray_get)
    assert rec.events[-1][0] == "finish" and rec.events[-1][2] is True


def test_progress_bar_does_not_finish_early(capsys):
    """ProgressBar draws from posttask: 100% must not show before the last task ends."""
    with ProgressBar(dt=0.05, out=sys.stdout):
        t0 = time.monotonic()
        dask.compute(_sleepy_graph(), scheduler=raydag.ray_get)
        elapsed = time.monotonic() - t0
    out = capsys.readouterr().out
    assert "100%" in out
    frames = [f for f in out.split("\r") if "%" in f]
    # With draws every 50 ms over >= 0.8 s, some frames must show partial progress.
    partial = [f for f in frames if "100%" not in f and "| 0%" not in f]
    assert elapsed > 0.8
    assert partial, frames


def test_profiler(assert_store_empty):
    with Profiler() as prof:
        dask.compute(_sleepy_graph(4, 0.05), scheduler=raydag.ray_get)
    keys = {r.key for r in prof.results}
    assert keys == {f"nap-{i}" for i in range(4)} | {"total"}
    for r in prof.results:
        assert r.start_time <= r.end_time
    assert_store_empty()


# ---- foreign keyword arguments --------------------------------------------------------


def test_foreign_kwargs_accepted_with_one_warning(assert_store_empty):
    x = dask.delayed(add)(dask.delayed(inc)(1), 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (got,) = dask.compute(
            x,
            scheduler=raydag.ray_get,
            resources={"cores": 1},
            worker_transfers=True,
            task_mode="function-calls",
            lib_resources={"cores": 2, "slots": 2},
            prune_depth=2,
        )
    assert got == 4
    ours = [w for w in caught if issubclass(w.category, IgnoredArgumentsWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    message = str(ours[0].message)
    for name in ("resources", "worker_transfers", "task_mode", "lib_resources", "prune_depth"):
        assert name in message
    assert "not known" not in message  # all of these are known foreign arguments
    assert_store_empty()


def test_no_warning_without_foreign_kwargs():
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredArgumentsWarning)
        assert dask.compute(dask.delayed(inc)(1), scheduler=raydag.ray_get) == (2,)


# ---- bad graphs -----------------------------------------------------------------------


def touch(path):
    with open(path, "w") as f:
        f.write("ran")
    return np.zeros(50_000)


def _assert_graph_error(dsk, keys, must_name, side_effect, assert_store_empty):
    with pytest.raises(raydag.GraphError) as info:
        raydag.ray_get(dsk, keys)
    for key in must_name:
        assert repr(key) in str(info.value), str(info.value)
    time.sleep(0.5)  # give a wrongly submitted task time to leave a trace
    assert not os.path.exists(side_effect), "a task ran before the graph was checked"
    assert_store_empty()


def test_cycle_is_a_graph_error(tmp_path, assert_store_empty):
    marker = str(tmp_path / "ran")
    dsk = {"side": (touch, marker), "a": (inc, "b"), "b": (inc, "a")}
    _assert_graph_error(dsk, ["side", "a"], ["a", "b"], marker, assert_store_empty)


def test_missing_dependency_is_a_graph_error(tmp_path, assert_store_empty):
    marker = str(tmp_path / "ran")
    dsk = {
        "side": Task("side", touch, marker),
        "a": Task("a", add, TaskRef("side"), TaskRef("nowhere")),
    }
    _assert_graph_error(dsk, ["side", "a"], ["a", "nowhere"], marker, assert_store_empty)


def test_missing_requested_key_is_a_graph_error(tmp_path, assert_store_empty):
    marker = str(tmp_path / "ran")
    dsk = {"side": (touch, marker), "a": 1}
    _assert_graph_error(dsk, [["side"], ["absent"]], ["absent"], marker, assert_store_empty)


# ---- Ctrl-C ------------------------------------------------------------------------------


CTRL_C_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import dask
    import numpy as np
    import raydag
    from raydag import runtime
    from dask.callbacks import Callback

    def nap(i):
        time.sleep(60)
        return np.zeros(50_000) + i

    class Announce(Callback):
        def _pretask(self, key, dsk, state):
            print("RUNNING", flush=True)

    dask.config.set({"raydag.local-ray.num-cpus": 2})
    runtime.connect()
    # warm the workers up so that the interrupt lands while the naps really run
    dask.compute(dask.delayed(int)(1), scheduler=raydag.ray_get)
    parts = [dask.delayed(nap)(i) for i in range(6)]
    try:
        with Announce():
            dask.compute(dask.delayed(sum)(parts), scheduler=raydag.ray_get)
    except KeyboardInterrupt:
        print("CAUGHT KeyboardInterrupt", flush=True)
        sys.exit(0)
    print("NOT INTERRUPTED", flush=True)
    sys.exit(1)
    """
)


@pytest.mark.slow
@pytest.mark.ray_only
def test_ctrl_c_interrupts_promptly(tmp_path):
    """SIGINT during a compute raises KeyboardInterrupt at once; the process then exits."""
    script = tmp_path / "ctrl_c.py"
    script.write_text(CTRL_C_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=str(tmp_path),
    )
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RUNNING"):
                break
        else:
            pytest.fail("the subprocess never started its tasks:\n" + "".join(lines))
        time.sleep(1.5)  # the naps are now sleeping on the workers
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("CAUGHT"):
                caught = time.monotonic() - sent
                break
        else:
            pytest.fail("KeyboardInterrupt was not caught:\n" + "".join(lines))
        rest, _ = proc.communicate(timeout=30)
        exited = time.monotonic() - sent
        lines.append(rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines)
    assert proc.returncode == 0, out
    assert caught < 3, f"KeyboardInterrupt took {caught:.1f} s\n{out}"
    assert exited < 10, f"the process took {exited:.1f} s to exit\n{out}"
