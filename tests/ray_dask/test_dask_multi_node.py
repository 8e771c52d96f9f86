# The test of python/ray/util/dask/tests/test_dask_multi_node.py in ray-project/ray
# (Apache-2.0; the version stored at commit d70bf2bf07858f56396bbd5ceaa5c1647eb0ef55,
# the newest found, for ray 2.60.0): the same test by name, making the same checks,
# written for this suite (see NOTICE). The conftest runs it on ray_dask_get and with
# raydag standing in, on a three-node ray.cluster_utils.Cluster (marked ``cluster``).
"""Ray task options for dask tasks: ``ray_remote_args``, by annotation and by keyword."""

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import ray
from ray.util.dask import enable_dask_on_ray

from raydag.api import IgnoredArgumentsWarning


@pytest.fixture
def ray_enable_dask_on_ray():
    with enable_dask_on_ray():
        yield


def node_id():
    return ray._private.worker.global_worker.node.unique_id


def row_node_id(row):
    return pd.Series(node_id())


def test_ray_dask_resources(ray_start_cluster, ray_enable_dask_on_ray, scheduler_under_test):
    cluster = ray_start_cluster
    cluster.add_node(num_cpus=1)
    cluster.add_node(num_cpus=1, resources={"other_pin": 1})
    pinned = cluster.add_node(num_cpus=1, num_gpus=1, resources={"pin": 1}).unique_id
    ray.init(address=cluster.address)

    # An annotation on the collection.
    with dask.annotate(ray_remote_args=dict(num_cpus=1, resources={"pin": 0.01})):
        task = dask.delayed(node_id)()
    assert task.compute(optimize_graph=False) == pinned

    # An annotation around the compute.
    task = dask.delayed(node_id)()
    with dask.annotate(ray_remote_args=dict(num_gpus=1, resources={"pin": 0.01})):
        assert task.compute(optimize_graph=False) == pinned

    # The compute's keyword, for every task.
    assert dask.delayed(node_id)().compute(ray_remote_args={"resources": {"pin": 0.01}}) == pinned

    # The collection's annotation wins over the compute's keyword.
    with dask.annotate(ray_remote_args=dict(resources={"pin": 0.01})):
        task = dask.delayed(node_id)()
    got = task.compute(ray_remote_args=dict(resources={"other_pin": 0.01}), optimize_graph=False)
    assert got == pinned

    # Ray resources given as dask's top-level resources are refused, both ways. The one
    # place raydag differs on purpose: it reads dask.annotate(resources=...) as Ray
    # resources (its documented API), and resources= is DaskVine's keyword, ignored.
    if scheduler_under_test == "ray_dask_get":
        with pytest.raises(ValueError):
            with dask.annotate(resources={"pin": 0.01}):
                task = dask.delayed(node_id)()
            task.compute(optimize_graph=False)
        with pytest.raises(ValueError):
            dask.delayed(node_id)().compute(resources={"pin": 0.01})
    else:
        with dask.annotate(resources={"pin": 0.01}):
            task = dask.delayed(node_id)()
        assert task.compute(optimize_graph=False) == pinned
        with pytest.warns(IgnoredArgumentsWarning, match="resources"):
            dask.delayed(node_id)().compute(resources={"pin": 0.01})

    # The same for a dataframe's tasks: an annotation around the compute, the keyword.
    df = dd.from_pandas(
        pd.DataFrame(np.random.randint(0, 2, size=(2, 2)), columns=["age", "grade"]),
        npartitions=2,
    )
    rows = df.apply(row_node_id, axis=1, meta={0: str})
    with dask.annotate(ray_remote_args=dict(num_gpus=1, resources={"pin": 0.01})):
        assert rows.compute(optimize_graph=False)[0].iloc[0] == pinned
    rows = df.apply(row_node_id, axis=1, meta={0: str})
    got = rows.compute(ray_remote_args={"resources": {"pin": 0.01}}, optimize_graph=False)
    assert got[0].iloc[0] == pinned
