"""Ray's tests of ``ray.util.dask``, run twice: on Ray's ``ray_dask_get`` and with raydag
standing in for it. The swap is made here and only here.

Every test of this folder is parametrised by ``scheduler_under_test``: ``[ray_dask_get]``
runs it as Ray wrote it; ``[raydag]`` first points the names the test module imported
from ``ray.util.dask`` (and ``ray.util.dask``'s own, for tests importing them in their
body) at raydag's: ``STAND_INS``. A name raydag does not have yet becomes a function
raising ``NotImplementedError`` naming it. What is not swapped: ``RayDaskCallback`` and
``ProgressBarCallback``, which a drop-in scheduler must honour as they are (users
subclass Ray's class; the scheduler reads ``RayDaskCallback.ray_active``), and
``ray.util.dask``'s patch of ``dask.persist``, which every user of ``ray.util.dask`` has:
it makes each persist call pass ``ray_persist=True`` to the scheduler's get.

``RAYDAG_XFAIL``: what fails with raydag standing in, and why; strict, so that a fix
shows up as XPASS, a failure, until its entry goes (none now). ``UPSTREAM_XFAIL``: for
Ray's unmodified files, where raydag differs from Ray on purpose (its ``resources``
annotation). ``SKIP``: tests that cannot pass on ``ray_dask_get`` itself here, skipped in
both runs.

Ray's unmodified test files run the same way: copy them into ``upstream/`` (ignored by
git), see README.md.
"""

from __future__ import annotations

import functools
import time
import warnings

import dask
import pytest
import ray

import raydag

# Ray's package, imported once here without the patch it applies to dask.persist on
# import: it would stay for the whole session, and raydag's own tests would get
# ray_persist=True (see tests/test_faults.py). It is applied for each test of this
# folder alone (_ray_dask_environment).
import ray.util.dask as ray_dask  # isort: skip

dask.persist = ray_dask.dask_persist
dask.base.DaskMethodsMixin.persist = ray_dask.dask_persist_mixin

from .ray_fixtures import (  # noqa: E402, F401  (fixtures)
    REAL_INIT,
    REAL_SHUTDOWN,
    ray_start_cluster,
    ray_start_regular_shared,
)

BACKENDS = ("ray_dask_get", "raydag")

# The names Ray's tests import from ray.util.dask -> the raydag attribute standing in.
STAND_INS = {
    "ray_dask_get": "ray_get",
    "ray_dask_get_sync": "ray_dask_get_sync",
    "enable_dask_on_ray": "enable_dask_on_ray",
    "disable_dask_on_ray": "disable_dask_on_ray",
}

# "file::test" -> why it cannot pass on ray_dask_get itself here: skipped in both runs.
SKIP: dict[str, str] = {}

# "file::test" -> why it fails with raydag standing in (the [raydag] run only). The
# hooks' contract, as ray_dask_get keeps it, is in README.md. None now.
RAYDAG_XFAIL: dict[str, str] = {}

# "file::test" -> where raydag's documented API differs from ray_dask_get's on purpose,
# for Ray's unmodified files in upstream/ (the [raydag] run only). This folder's
# restatement checks raydag's behaviour there instead (``scheduler_under_test``).
UPSTREAM_XFAIL: dict[str, str] = {
    "test_dask_multi_node.py::test_ray_dask_resources": (
        "Ray refuses dask.annotate(resources=...) and the resources= keyword with "
        "ValueError; raydag reads the annotation as Ray resources (its documented API, "
        "docs/semantics.md) and takes resources= as DaskVine's keyword (ignored, warned)"
    ),
}


def _missing(ray_name: str, raydag_name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"raydag has no {raydag_name} (standing in for ray.util.dask.{ray_name})"
        )

    missing.__name__ = raydag_name
    return missing


def stand_in(ray_name: str):
    """raydag's attribute standing in for ``ray.util.dask.<ray_name>``."""
    name = STAND_INS[ray_name]
    return getattr(raydag, name, None) or _missing(ray_name, name)


def _key(item: pytest.Item) -> str:
    return f"{item.path.name}::{item.originalname}"


@pytest.fixture(autouse=True, params=BACKENDS)
def scheduler_under_test(request, monkeypatch):
    """Which scheduler the test runs on; with raydag, swap the names it imported."""
    if request.param == "raydag":
        for ray_name in STAND_INS:
            for namespace in (request.module, ray_dask):
                if hasattr(namespace, ray_name):
                    monkeypatch.setattr(namespace, ray_name, stand_in(ray_name))
    return request.param


@pytest.fixture(autouse=True)
def _ray_dask_environment(request, monkeypatch):
    """What a user of ray.util.dask has, for this test alone.

    - ``dask.persist`` patched by ray.util.dask to pass ``ray_persist=True``;
    - dask's config restored afterwards: Ray's tests call ``enable_dask_on_ray()``
      and ``disable_dask_on_ray()`` outside any ``with``, which set it for good, and a
      failure between the two would leave the next tests on ray_dask_get;
    - ``ray.init()`` without an address, or with the shared Ray's (which is
      ``ray_start_cluster``'s), is the session's shared Ray, and ``ray.shutdown()``
      does nothing: Ray's fixtures in its test modules (such as ``ray_start_1_cpu``)
      start and stop a Ray for every test, 10-20 s each here;
    - afterwards, ProgressBarCallback's actor killed, and the shared Ray shut down if
      the test left objects in its store.
    """
    monkeypatch.setattr(dask, "persist", ray_dask.ray_dask_persist)
    monkeypatch.setattr(dask.base.DaskMethodsMixin, "persist", ray_dask.ray_dask_persist_mixin)

    @functools.wraps(REAL_INIT)
    def init(address=None, **kwargs):
        if address is not None and not (
            ray.is_initialized() and address == ray.get_runtime_context().gcs_address
        ):
            return REAL_INIT(address, **kwargs)
        request.getfixturevalue("ray_cluster")  # tests/conftest.py: starts it if need be
        return REAL_INIT(ignore_reinit_error=True)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda *args, **kwargs: None)
    saved = {k: dask.config.config[k] for k in DASK_ON_RAY_CONFIG if k in dask.config.config}
    try:
        yield
    finally:
        for k in DASK_ON_RAY_CONFIG:
            dask.config.config.pop(k, None)
        dask.config.config.update(saved)
        raydag.disable()  # Ray's tests call enable_dask_on_ray() outside any with
        _kill_progress_bar_actor()
        _restart_ray_if_leaked(request.node.nodeid)


# What enable_dask_on_ray and disable_dask_on_ray set in dask's config.
DASK_ON_RAY_CONFIG = ("scheduler", "shuffle", "dataframe_optimize")


def _kill_progress_bar_actor(timeout: float = 5.0) -> None:
    """``ProgressBarCallback`` reuses a named actor if there is one. One made in a Ray
    task (test_ray_dask_basic) dies when that task's worker collects its handle, at
    any time, and the next test using it fails with ActorDiedError: kill it now."""
    if not ray.is_initialized():
        return
    try:
        actor = ray.get_actor(PROGRESS_BAR_ACTOR)
    except ValueError:
        return
    ray.kill(actor)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(PROGRESS_BAR_ACTOR)
        except ValueError:
            return
        time.sleep(0.05)


PROGRESS_BAR_ACTOR = "_dask_on_ray_pb"  # ray.util.dask.callbacks.ProgressBarCallback


def _restart_ray_if_leaked(nodeid: str, settle: float = 2.0) -> None:
    """Shut the shared Ray down if a test left objects in its store (``ray_cluster``
    starts it again): raydag's own tests check that the store is empty after each
    compute, and would fail for them. Ray's test_ray_dask_basic, for one, pins an
    object for the job's life (an ObjectRef captured by a Ray task defined in it)."""
    if not ray.is_initialized():
        return
    from raydag.runtime.stores import store_stats

    deadline = time.monotonic() + settle
    while objects := sum(s.num_objects for s in store_stats().values()):
        if time.monotonic() > deadline:
            warnings.warn(
                f"{nodeid} left {objects} objects in Ray's object store: shut down "
                "so that the next tests get a new Ray with an empty store",
                stacklevel=1,
            )
            REAL_SHUTDOWN()
            return
        time.sleep(0.05)


@pytest.fixture
def ray_start_1_cpu(ray_cluster):
    """Ray's test_dask_callback.py starts a 2-CPU Ray per test: the shared one here."""
    return REAL_INIT(ignore_reinit_error=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Skips and xfails from the tables; every test marked ``ray_only`` (Ray's
    Dask-on-Ray API on raydag's Ray layer: the tests session runs them, on the newest
    dask), multi-node tests ``cluster`` too (run last by tests/conftest.py)."""
    for item in items:
        if "scheduler_under_test" not in getattr(item, "fixturenames", ()):
            continue  # not this folder's
        item.add_marker(pytest.mark.ray_only)
        key = _key(item)
        if key in SKIP:
            item.add_marker(pytest.mark.skip(reason=f"fails on ray_dask_get: {SKIP[key]}"))
        elif item.callspec.params.get("scheduler_under_test") == "raydag":
            upstream = item.path.parent.name == "upstream"
            reason = (UPSTREAM_XFAIL if upstream else {}).get(key) or RAYDAG_XFAIL.get(key)
            if reason:
                item.add_marker(pytest.mark.xfail(strict=True, reason=reason))
        if "ray_start_cluster" in item.fixturenames:
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.slow)
