"""Ray's Dask-on-Ray API on raydag, beyond Ray's own tests (tests/ray_dask/): the
RayDaskCallback hooks around fused groups, a presubmit hook turning fusion off,
``ray_callbacks=``, ``ray_remote_args`` reaching the Ray task, ``ray_persist=True``
graphs computed again, Ray's config helpers, and clear errors for bad input."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest
import ray

import raydag
from raydag.core.options import OptionsError

# Importing ray.util.dask patches dask.persist for good (it adds ray_persist=True):
# undone at once, so that raydag's other tests never see it (as tests/ray_dask does).
import ray.util.dask as ray_dask  # isort: skip

dask.persist = ray_dask.dask_persist
dask.base.DaskMethodsMixin.persist = ray_dask.dask_persist_mixin
from ray.util.dask import RayDaskCallback  # noqa: E402

pytestmark = pytest.mark.usefixtures("ray_cluster")


@ray.remote(num_cpus=0)
class Calls:
    """What the hooks saw, wherever they ran (the driver, the workers)."""

    def __init__(self):
        self.calls = []

    def add(self, *call):
        self.calls.append(call)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


@pytest.fixture
def calls(ray_cluster):
    actor = Calls.remote()
    yield actor
    ray.kill(actor)


def inc(x):
    return x + 1


def chain(n: int):
    x = dask.delayed(inc, pure=False)(0)
    for _ in range(n - 1):
        x = dask.delayed(inc, pure=False)(x)
    return x


class Recording(RayDaskCallback):
    """Every hook, recorded with the Ray task it ran in (pre/posttask)."""

    def __init__(self, calls):
        self.calls = calls

    def _ray_postsubmit(self, task, key, deps, object_ref):
        ray.get(self.calls.add.remote("postsubmit", key, object_ref.hex(), sorted(deps)))

    def _ray_pretask(self, key, object_refs):
        task_id = ray.get_runtime_context().get_task_id()
        ray.get(self.calls.add.remote("pretask", key, task_id, list(object_refs)))
        return ("state", key)

    def _ray_posttask(self, key, result, pre_state):
        task_id = ray.get_runtime_context().get_task_id()
        ray.get(self.calls.add.remote("posttask", key, task_id, (result, pre_state)))

    def _ray_postsubmit_all(self, object_refs, dsk):
        self.calls.add.remote("postsubmit_all", len(object_refs), len(dsk))

    def _ray_finish(self, result):
        self.calls.add.remote("finish", result)


class ShortCircuit(Recording):
    """Recording, and a presubmit hook giving ``shortcut[key]`` in place of the task."""

    def __init__(self, calls, shortcut):
        super().__init__(calls)
        self.shortcut = shortcut

    def _ray_presubmit(self, task, key, deps):
        return self.shortcut.get(key)


def _by_hook(records):
    out = {}
    for hook, *rest in records:
        out.setdefault(hook, []).append(rest)
    return out


def test_hooks_around_a_fused_chain(calls):
    """A chain of cheap tasks: the first runs alone (its cost unknown), the rest in one
    Ray task. pre/posttask fire per dask task in that Ray task, each posttask with its
    own result and pretask state; postsubmit once per dask task, the fused ones with
    their group's ref; postsubmit_all and finish once."""
    x = chain(8)
    with Recording(calls):
        assert x.compute(scheduler=raydag.ray_get, optimize_graph=False) == 8
    seen = _by_hook(ray.get(calls.take.remote()))
    keys = {key for key, *_ in seen["pretask"]}
    assert len(keys) == 8 == len(seen["pretask"]) == len(seen["posttask"])
    assert sorted(r for _, _, (r, _) in seen["posttask"]) == list(range(1, 9))
    assert all(state == ("state", key) for key, _, (_, state) in seen["posttask"])
    tasks = {}
    for key, task_id, _ in seen["pretask"]:
        tasks.setdefault(task_id, []).append(key)
    assert len(max(tasks.values(), key=len)) > 1, "nothing was fused"
    assert sorted(k for k, *_ in seen["postsubmit"]) == sorted(keys)
    ref_of = {key: ref for key, ref, _ in seen["postsubmit"]}
    for members in tasks.values():  # one Ray task: one ref for all of its dask tasks
        assert len({ref_of[k] for k in members}) == 1
    assert seen["postsubmit_all"] == [[1, 8]]
    # what ray_get returns: the outputs in the nesting of the keys dask passed, which is
    # [key] on the newest dask and [[key]] on 2025.3 (its compute nests once more)
    assert seen["finish"] in ([[[8]]], [[[[8]]]]), seen["finish"]


def test_presubmit_value_stands_for_the_task_and_fusion_is_off(calls):
    """A presubmit hook's value is the task's: it does not run, its dependents read the
    value. With such a hook each dask task is its own Ray task."""
    x = chain(6)
    keys = sorted(x.__dask_graph__(), key=str)
    order = {k: i for i, k in enumerate(dask.order.order(dict(x.__dask_graph__())))}
    middle = sorted(keys, key=lambda k: order[k])[2]  # the third inc: 100 in its place
    with ShortCircuit(calls, shortcut={middle: 100}):
        assert x.compute(scheduler=raydag.ray_get, optimize_graph=False) == 103
    seen = _by_hook(ray.get(calls.take.remote()))
    ran = [key for key, _, _ in seen["pretask"]]
    assert middle not in ran and len(ran) == 5
    assert len({task_id for _, task_id, _ in seen["pretask"]}) == 5  # none fused
    assert middle not in [k for k, *_ in seen["postsubmit"]]
    assert [100] in [refs for key, _, refs in seen["pretask"]]  # its dependent read it


def test_ray_callbacks_keyword_in_place_of_the_active_ones(calls):
    """``ray_callbacks=``: those callbacks (or their RayCallback tuples) and not the
    active ones, which stay active."""
    given = Recording(calls)

    class Active(RayDaskCallback):
        def _ray_finish(self, result):
            raise AssertionError("an active callback was called despite ray_callbacks=")

    with Active():
        for callbacks in ([given], [given._ray_callback]):
            got = chain(2).compute(scheduler=raydag.ray_get, ray_callbacks=callbacks)
            assert got == 2
            finish = ray.get(calls.take.remote())[-1]  # dask 2025.3 nests the keys once more
            assert finish in (("finish", [2]), ("finish", [[2]])), finish
        assert RayDaskCallback.ray_active


def test_a_hook_error_is_the_computes():
    class Broken(RayDaskCallback):
        def _ray_posttask(self, key, result, pre_state):
            raise KeyError("from the hook")

    with Broken(), pytest.raises(KeyError, match="from the hook"):
        chain(2).compute(scheduler=raydag.ray_get)


def test_bad_callbacks_are_refused_before_anything_runs():
    class WrongSignature(RayDaskCallback):
        def _ray_postsubmit(self, task, key):
            raise AssertionError("never called")

    with (
        WrongSignature(),
        pytest.raises(
            TypeError,
            match=r"_ray_postsubmit of .*WrongSignature must take \(task, key, deps, object_ref\)",
        ),
    ):
        chain(2).compute(scheduler=raydag.ray_get)
    with pytest.raises(TypeError, match="ray_callbacks must hold .*RayDaskCallback"):
        chain(2).compute(scheduler=raydag.ray_get, ray_callbacks=[print])


def assigned_cpus():
    return ray.get_runtime_context().get_assigned_resources().get("CPU")


def test_ray_remote_args_reach_the_ray_task():
    """The keyword for every task, the annotation over it; the task's Ray task gets
    those options."""
    task = dask.delayed(assigned_cpus, pure=False)()
    assert task.compute(scheduler=raydag.ray_get) == 1.0
    assert task.compute(scheduler=raydag.ray_get, ray_remote_args={"num_cpus": 2}) == 2.0
    with dask.annotate(ray_remote_args={"num_cpus": 0.5}):
        annotated = dask.delayed(assigned_cpus, pure=False)()
    got = annotated.compute(
        scheduler=raydag.ray_get, ray_remote_args={"num_cpus": 2}, optimize_graph=False
    )
    assert got == 0.5
    with dask.annotate(ray_remote_args={"num_cpus": 0.25}):  # around the compute
        assert task.compute(scheduler=raydag.ray_get, optimize_graph=False) == 0.25


@pytest.mark.parametrize(
    ("ray_remote_args", "error", "match"),
    [
        (["num_cpus"], TypeError, "ray_remote_args must be a dict of Ray task options"),
        ({"num_cpu": 1}, OptionsError, "Invalid option keyword num_cpu"),
        ({"num_cpus": "two"}, OptionsError, "num_cpus"),
        ({"resources": {"CPU": 1}}, OptionsError, "num_cpus"),
        ({"num_returns": 2}, OptionsError, "raydag sets num_returns itself"),
    ],
)
def test_bad_ray_remote_args_are_refused_before_anything_runs(ray_remote_args, error, match):
    ran = []
    task = dask.delayed(ran.append)(1)
    with pytest.raises(error, match=match):
        task.compute(scheduler=raydag.ray_get, ray_remote_args=ray_remote_args)
    assert not ran


def test_ray_persist_leaves_object_refs_that_compute_again():
    """``ray_persist=True`` (what ray.util.dask's patch of dask.persist passes): the
    persisted graph holds plain ObjectRefs, which a later compute reads as data."""
    x = da.arange(10, chunks=5) + 1
    (persisted,) = dask.persist(x, scheduler=raydag.ray_get, ray_persist=True)
    values = list(dict(persisted.__dask_graph__()).values())
    assert len(values) == 2
    assert all(isinstance(getattr(v, "value", v), ray.ObjectRef) for v in values)
    np.testing.assert_array_equal(
        (persisted * 2).compute(scheduler=raydag.ray_get), (np.arange(10) + 1) * 2
    )
    (refs,) = raydag.ray_dask_persist(x)
    assert all(
        isinstance(getattr(v, "value", v), ray.ObjectRef)
        for v in dict(refs.__dask_graph__()).values()
    )
    del persisted, refs, values


def test_enable_dask_on_ray_as_ray_has_it():
    """Ray's config helpers: raydag as the scheduler, its shuffle for Ray's defaults or
    the method given; for good or as a context manager; disable undoes it."""
    from raydag import shuffle

    before = dask.config.get("scheduler", None)
    with raydag.enable_dask_on_ray():
        assert dask.config.get("scheduler") is raydag.ray_get
        assert dask.config.get("dataframe.shuffle.method") == shuffle.METHOD
        assert chain(3).compute() == 3
    assert dask.config.get("scheduler", None) is before
    raydag.enable_dask_on_ray(shuffle="disk", use_shuffle_optimization=False)
    try:
        assert dask.config.get("scheduler") is raydag.ray_get
        assert dask.config.get("dataframe.shuffle.method") == "disk"
    finally:
        raydag.disable_dask_on_ray()
    assert dask.config.get("scheduler", None) is before
    assert raydag.ray_dask_get is raydag.ray_get
    assert chain(2).compute(scheduler=raydag.ray_dask_get_sync) == 2
