"""A pytest plugin: every compute of dask's own tests runs on raydag.

distributed runs dask's tests against its own scheduler; this does the same for
raydag. dask's tests name their schedulers (``assert_eq`` computes with
``scheduler="sync"``, others ask for ``"threads"`` or ``"processes"``), so every name
of dask's local schedulers is pointed at raydag, and so is the default. The keyword
arguments meant for those schedulers (``num_workers``, ``pool``) are dropped before
raydag sees them, as the scheduler they were meant for is not running.

    pytest -p raydag_everywhere --pyargs dask.tests.test_delayed

(``tests/dask_suite`` on ``PYTHONPATH``). Tests known to fail under any multi-process
scheduler are listed in ``KNOWN``, each with its reason, and run as strict xfails: a
fix shows up as an unexpected pass.
"""

from __future__ import annotations

import os

import dask
import dask.base
import pytest

import raydag

LOCAL_NAMES = (
    "sync", "synchronous", "single-threaded", "threads", "threading", "processes",
    "multiprocessing",
)  # fmt: skip
LOCAL_KWARGS = ("num_workers", "pool", "chunksize", "func_dumps", "func_loads", "initializer")

# test id (as pytest prints it, under the dask package) -> why no multi-process
# scheduler can pass it as written.
IDENTITY = "asserts that a computed value is the very object the graph holds (``is``)"
KNOWN: dict[str, str] = {
    "dask.tests.test_delayed::test_traverse_false": IDENTITY,
    "dask.tests.test_delayed::test_callable_obj": IDENTITY,
    "dask.bag.tests.test_bag::test_bag_with_single_callable": IDENTITY
    + ": a lambda equals only itself",
    "dask.bag.tests.test_bag::test_repartition_partition_size_complex_dtypes": IDENTITY
    + ": ``list == list`` of numpy arrays holds only by identity (``==`` of two arrays "
    "is an array, whose truth value is ambiguous)",
    "dask.bag.tests.test_bag::test_to_delayed_optimize_graph": "counts the calls of a "
    "function monkeypatched in the driver's process; the tasks run in Ray's workers",
    "dask.bag.tests.test_bag::test_reductions_are_lazy": "the graph holds a live "
    "generator, and two tasks share a closure's cell: neither leaves the driver's process",
}


# dask's own pytest configuration turns warnings into errors, and some tests rely on
# it; this run does not load that configuration, so they get the one filter they need.
FILTERS: dict[str, str] = {
    "dask.array.tests.test_reductions::test_nanquantile_all_nan": "error::RuntimeWarning",
}


def raydag_get(dsk, keys, **kwargs):
    for name in LOCAL_KWARGS:
        kwargs.pop(name, None)
    return raydag.ray_get(dsk, keys, **kwargs)


def pytest_configure(config: pytest.Config) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    # Ray's workers import what the tests define by reference: the test modules are
    # importable from dask's package, the plugin from here.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    for name in LOCAL_NAMES:
        dask.base.named_schedulers[name] = raydag_get
    dask.config.set(scheduler=raydag_get)
    with dask.config.set({"raydag.local-ray.num-cpus": 2}):
        try:
            raydag.connect()
        except Exception:  # a raylet can time out starting on a loaded machine: once more
            import ray

            ray.shutdown()
            raydag.connect()


def pytest_unconfigure(config: pytest.Config) -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _name(item) in FILTERS:
            item.add_marker(pytest.mark.filterwarnings(FILTERS[_name(item)]))
        why = KNOWN.get(_name(item))
        if why is not None:
            item.add_marker(pytest.mark.xfail(reason=why, strict=True))


def _name(item: pytest.Item) -> str:
    module = item.module.__name__ if item.module is not None else ""
    return f"{module}::{item.name}"
