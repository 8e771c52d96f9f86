# The tests of python/ray/util/dask/tests/test_dask_callback.py in ray-project/ray
# (Apache-2.0; the version stored at commit 32452f97ba120882ac6c3bbcaf6c5d07ed78e0c3,
# the newest found, for ray 2.60.0): the same tests by name, each making the same
# checks, written for this suite (see NOTICE). The conftest runs each on ray_dask_get
# and with raydag standing in.
"""Ray's RayDaskCallback hooks, as its tests check them."""

import operator

import dask
import pytest
import ray
from ray.util.dask import RayDaskCallback, ray_dask_get

add = dask.delayed(operator.add)


@ray.remote(num_cpus=0)
class Recorder:
    """Counts calls of the hooks (an actor, as in Ray's tests: hooks may run anywhere)."""

    def __init__(self):
        self.calls = {}

    def reset(self):
        self.calls = {}

    def record(self, hook):
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def count(self, hook):
        return self.calls.get(hook, 0)


_recorders = {}  # the driver's node id (a new one for each Ray started) -> its Recorder


@pytest.fixture
def recorder(ray_start_1_cpu):
    """One Recorder for all tests, emptied for each: an actor costs a worker process
    (1-2 s here) where Ray's tests make one per test."""
    node = ray.get_runtime_context().get_node_id()
    if node not in _recorders:
        _recorders.clear()
        _recorders[node] = Recorder.remote()
    ray.get(_recorders[node].reset.remote())
    return _recorders[node]


def test_callback_active():
    assert not RayDaskCallback.ray_active
    with RayDaskCallback():
        assert RayDaskCallback.ray_active
    assert not RayDaskCallback.ray_active


def test_presubmit_shortcircuit(ray_start_1_cpu):
    """A value returned by _ray_presubmit is the task's result: nothing is submitted."""

    class ShortCircuit(RayDaskCallback):
        def _ray_presubmit(self, task, key, deps):
            return 0

        def _ray_postsubmit(self, task, key, deps, object_ref):
            pytest.fail("_ray_postsubmit called although _ray_presubmit returned a value")

    with ShortCircuit():
        assert add(2, 3).compute(scheduler=ray_dask_get) == 0


def test_pretask_posttask_shared_state(ray_start_1_cpu):
    """What _ray_pretask returns reaches _ray_posttask as pre_state."""

    class Shared(RayDaskCallback):
        def _ray_pretask(self, key, object_refs):
            return key

        def _ray_posttask(self, key, result, pre_state):
            assert pre_state == key

    with Shared():
        assert add(2, 3).compute(scheduler=ray_dask_get) == 5


class Counting(RayDaskCallback):
    """Records each call of the hooks in ``hooks`` with ``recorder``."""

    def __init__(self, recorder, hooks):
        self.recorder = recorder
        for hook in hooks:
            setattr(self, hook, self._recording(hook))

    def _recording(self, hook):
        return lambda *args: self.recorder.record.remote(hook)


def test_postsubmit(recorder):
    with Counting(recorder, ["_ray_postsubmit"]):
        assert add(2, 3).compute(scheduler=ray_dask_get) == 5
    assert ray.get(recorder.count.remote("_ray_postsubmit")) == 1


def test_postsubmit_all(recorder):
    with Counting(recorder, ["_ray_postsubmit_all"]):
        assert add(2, 3).compute(scheduler=ray_dask_get) == 5
    assert ray.get(recorder.count.remote("_ray_postsubmit_all")) >= 1


def test_finish(recorder):
    with Counting(recorder, ["_ray_finish"]):
        assert add(2, 3).compute(scheduler=ray_dask_get) == 5
    assert ray.get(recorder.count.remote("_ray_finish")) >= 1


def test_multiple_callbacks(recorder):
    """Each of three active callbacks has its _ray_postsubmit called."""
    callbacks = [Counting(recorder, ["_ray_postsubmit"]) for _ in range(3)]
    with callbacks[0], callbacks[1], callbacks[2]:
        assert add(2, 3).compute(scheduler=ray_dask_get) == 5
    assert ray.get(recorder.count.remote("_ray_postsubmit")) == 3


def test_pretask_posttask_shared_state_multi(ray_start_1_cpu):
    """Each callback's _ray_posttask gets its own _ray_pretask's value, or None."""

    class Suffixed(RayDaskCallback):
        def __init__(self, suffix):
            self.suffix = suffix

        def _ray_pretask(self, key, object_refs):
            return key + self.suffix

        def _ray_posttask(self, key, result, pre_state):
            assert pre_state == key + self.suffix

    class PretaskOnly(RayDaskCallback):
        def _ray_pretask(self, key, object_refs):
            return "baz"

    class PosttaskOnly(RayDaskCallback):
        def _ray_posttask(self, key, result, pre_state):
            assert pre_state is None

    with Suffixed("foo"), PretaskOnly(), PosttaskOnly(), Suffixed("bar"):
        assert add(2, 3).compute(scheduler=ray_dask_get) == 5
