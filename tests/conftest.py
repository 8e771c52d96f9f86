"""One embedded local Ray for the whole session, and a check that raydag left nothing behind."""

from __future__ import annotations

import contextlib
import os
import time
import warnings

import dask
import pytest
import ray

import raydag.runtime
from raydag.runtime.stores import store_stats

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def _start_local_ray() -> None:
    # Ray workers inherit the raylet's environment: let them import the test modules,
    # whose functions and exception classes cloudpickle ships by reference.
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, old_path) if p)
    try:
        with dask.config.set({"raydag.local-ray.num-cpus": 2}):
            try:
                raydag.connect()
            except Exception:  # a raylet can time out starting on a loaded machine: once more
                ray.shutdown()
                raydag.connect()
    finally:
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="session")
def _local_ray_session():
    """Start Ray once: starting it costs 10-20 s here, far more than any test."""
    if ray.is_initialized():  # someone else's Ray would make the store checks meaningless
        ray.shutdown()
    _start_local_ray()
    yield
    ray.shutdown()


@pytest.fixture
def ray_cluster(_local_ray_session):
    """The shared embedded Ray, started again if a multi-node test shut it down."""
    if not ray.is_initialized():
        _start_local_ray()


@pytest.fixture(scope="module")
def clusters():
    """The chaos kit's multi-node cluster, one at a time for the module (tests/chaos.py)."""
    from chaos import Clusters

    cs = Clusters()
    try:
        yield cs
    finally:
        cs.close()


def pytest_collection_modifyitems(config, items):
    """Multi-node tests last: each replaces the shared local Ray with its own cluster."""
    items.sort(key=lambda item: item.get_closest_marker("cluster") is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Once a failure is reported, let go of its frames' locals: a failed test's
    traceback would otherwise keep its ObjectRefs (and their objects) alive into the
    next tests on the same cluster, which then fail on a store that is not empty."""
    yield
    if call.excinfo is not None and not item.config.getoption("usepdb", False):
        _drop_locals(call.excinfo.value)


def _drop_locals(error: BaseException | None) -> None:
    """Clear the finished frames of ``error``'s traceback and of the errors it chains."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            with contextlib.suppress(RuntimeError):  # a frame still running: pytest's own
                tb.tb_frame.clear()
                tb.tb_frame.f_locals  # noqa: B018 (Python < 3.13 keeps a copy: re-sync it)
            tb = tb.tb_next
        error = error.__cause__ or error.__context__


def store_objects() -> tuple[int, int]:
    """(objects, bytes) in the object stores of all alive nodes."""
    try:
        stats = store_stats().values()
    except ModuleNotFoundError as e:  # ray without its [default] extra has no grpc
        pytest.fail(f"cannot read the object stores ({e}): install grpcio or ray[default]")
    return sum(s.num_objects for s in stats), sum(s.used_bytes for s in stats)


def _describe_leftovers() -> str:
    """What is in the stores and which refs still point at objects, for a failure message."""
    from ray._private.internal_api import node_stats

    lines = []
    for n in ray.nodes():
        if not n["Alive"]:
            continue
        s = node_stats(n["NodeManagerAddress"], n["NodeManagerPort"], include_memory_info=True)
        lines.append(str(s.store_stats).replace("\n", "; "))
        for w in s.core_workers_stats:
            if w.num_running_tasks or w.used_resources:
                used = {
                    k: sum(x.allocation for x in v.resource_slots)
                    for k, v in w.used_resources.items()
                }
                lines.append(f"  pid {w.pid}: {w.num_running_tasks} running, using {used}")
            for r in w.object_refs:
                if r.object_size > 0 or r.pinned_in_memory:
                    lines.append(
                        f"  pid {w.pid}: {r.object_id.hex()} {r.object_size} B "
                        f"local_refs={r.local_ref_count} pinned={r.pinned_in_memory} "
                        f"{r.call_site or ''}"
                    )
    return "\n".join(lines)


def _left_before(settle: float = 1.0) -> int:
    """Objects in the stores as a test starts, once the last test's have had ``settle``
    seconds to go: more than none only if an earlier test leaked (and failed for it)."""
    deadline = time.monotonic() + settle
    while (objects := store_objects()[0]) and time.monotonic() < deadline:
        time.sleep(0.02)
    return objects


@pytest.fixture
def assert_store_empty(ray_cluster):
    """Call after a compute: raydag must free every object it made, without gc.collect().

    Objects an earlier test left are that test's failure, not this one's: they are not
    counted again, so that one leak does not fail every later test of the session.
    """
    before = _left_before()
    if before:
        warnings.warn(f"{before} objects left in the stores by an earlier test", stacklevel=1)

    def check(timeout: float = 3.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            objects, nbytes = store_objects()
            if objects <= before:
                return
            if time.monotonic() > deadline:
                pytest.fail(
                    f"object store still holds {objects} objects ({nbytes} bytes) "
                    f"after {timeout} s, {before} of them left by an earlier test:\n"
                    f"{_describe_leftovers()}"
                )
            time.sleep(0.02)

    return check


@pytest.fixture
def describe_leftovers(ray_cluster):
    """What the stores and the workers hold now, for a failure message."""
    return _describe_leftovers


@pytest.fixture
def store_count(ray_cluster):
    """Objects in the store now: to show that a check for emptiness could fail."""
    return lambda: store_objects()[0]
