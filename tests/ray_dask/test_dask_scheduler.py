# The tests of python/ray/util/dask/tests/test_dask_scheduler.py in ray-project/ray
# (Apache-2.0; its newest version found, for ray 2.60.0: the one using
# ray_start_regular_shared and set_index(shuffle_method="tasks")): the same tests by
# name, each making the same checks, written for this suite (see NOTICE). The conftest
# runs each on ray_dask_get and with raydag standing in.
"""Ray's scheduler entry points: the get, the config helpers, persist, the progress bar."""

import dask
import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import ray
from ray.util.client.common import ClientObjectRef
from ray.util.dask import disable_dask_on_ray, enable_dask_on_ray, ray_dask_get
from ray.util.dask.callbacks import ProgressBarCallback


@ray.remote
def describe(x):
    return f"The answer is {x}"


@ray.remote
def compute_in_ray(collection, scheduler):
    with ProgressBarCallback():
        return collection.compute(scheduler=scheduler)


def test_ray_dask_basic(ray_start_regular_shared):
    """Tasks can read Ray objects and call Ray tasks; the scheduler is chosen by
    argument, by the config helpers (set for good, then as a context manager), and
    from inside a Ray task, with a progress bar callback active."""
    zero = ray.put(0)

    @dask.delayed
    def answer(x, y):
        return ray.get(describe.remote(x + y + ray.get(zero)))

    expected = "The answer is 6"
    assert answer(2, 4).compute(scheduler=ray_dask_get) == expected

    enable_dask_on_ray()
    assert answer(2, 4).compute() == expected
    disable_dask_on_ray()

    with enable_dask_on_ray():
        assert answer(2, 4).compute() == expected

    # Ray's test defines this Ray task here, capturing the collection, and so the
    # ObjectRef `zero`: Ray then pins that object for as long as the job lives, and
    # raydag's tests that want an empty store fail. Given as arguments, it is freed.
    assert ray.get(compute_in_ray.remote(answer(2, 4), ray_dask_get)) == expected


def test_ray_dask_persist(ray_start_regular_shared):
    """persist (given ray_persist=True by ray.util.dask's patch) leaves ObjectRefs in
    the persisted collection's graph."""
    persisted = (da.ones(5) + 2).persist(scheduler=ray_dask_get)
    value = next(iter(persisted.dask.values()))
    assert isinstance(value, (ray.ObjectRef, ClientObjectRef))


def test_sort_with_progress_bar(ray_start_regular_shared):
    """A task-based sort gives the same frame with Ray's progress bar as without."""
    npartitions = 10
    df = dd.from_pandas(
        pd.DataFrame(np.random.randint(0, 100, size=(100, 2)), columns=["age", "grade"]),
        npartitions=npartitions,
    )

    def sort():
        return df.set_index(["age"], shuffle_method="tasks", max_branch=npartitions)

    with ProgressBarCallback():
        with_bar = sort().compute(scheduler=ray_dask_get, _ray_enable_progress_bar=True)
    without_bar = sort().compute(scheduler=ray_dask_get)
    assert with_bar.equals(without_bar)
