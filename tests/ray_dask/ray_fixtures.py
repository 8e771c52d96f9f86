"""What Ray's dask tests take from ``ray.tests.conftest``, on this suite's Ray.

The ray wheel does not ship ``ray.tests``. Ray's dask tests use two of its fixtures:
``ray_start_regular_shared`` (a local Ray for the module) and ``ray_start_cluster``
(an empty ``ray.cluster_utils.Cluster`` the test adds nodes to and connects to). Here
the first is the session's shared local Ray of ``tests/conftest.py`` (2 CPUs, started
once: starting Ray costs 10-20 s on this suite's machines), and the second adds the
test's nodes to that Ray, for the test.

This module also stands in for ``ray.tests.conftest`` itself (``__init__.py``), so that
Ray's test files run unmodified: ``from ray.tests.conftest import *`` imports these.
"""

from __future__ import annotations

import os

import pytest
import ray

# The real ones: the conftest replaces ray.init and ray.shutdown during each test.
REAL_INIT = ray.init
REAL_SHUTDOWN = ray.shutdown

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["ray_start_cluster", "ray_start_regular_shared"]


@pytest.fixture
def ray_start_regular_shared(ray_cluster):
    """Ray's module-scoped local Ray (1 CPU there): the session's shared one here."""
    return REAL_INIT(ignore_reinit_error=True)


@pytest.fixture
def ray_start_cluster(ray_cluster, monkeypatch):
    """A ``ray.cluster_utils.Cluster`` the test adds nodes to and connects to.

    Ray's is empty: the test's first ``add_node`` starts its head, then it connects.
    Here the session's shared Ray, already connected to, is the head, the test's nodes
    join it and are removed after the test: a head takes 12-15 s to start on 2 cores,
    and the shared Ray would have to go (one Ray per driver) and start again.
    ``ray.init(address=cluster.address)`` returns the connected Ray (conftest.py).
    """
    from ray.cluster_utils import Cluster

    # Workers inherit the raylets' environment: let them import the test modules,
    # whose module-level functions cloudpickle ships by reference.
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (TESTS_DIR, path) if p))
    cluster = Cluster()
    cluster.head_node = ray._private.worker._global_node
    cluster.redis_address = cluster.head_node.redis_address
    try:
        yield cluster
    finally:
        try:
            for node in list(cluster.worker_nodes):
                cluster.remove_node(node)
        finally:
            cluster.head_node = None  # the shared Ray is not the cluster's to stop
