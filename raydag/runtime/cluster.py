"""The cluster raydag runs on: connecting, the alive nodes and their free CPUs."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping

import ray

from raydag import config

logger = logging.getLogger(__name__)

# Ray returns a task's values below ``max_direct_call_object_size`` inline to their
# owner (the driver), as long as the task's inlined values stay below
# ``task_rpc_inlined_bytes_limit``: no node's death can lose them. Ray's defaults.
INLINE_BYTES = 100 * 1024
INLINE_TOTAL = 10 * 1024 * 1024


def connect() -> None:
    """Use the initialised Ray or ``RAY_ADDRESS``; otherwise start an embedded local Ray,
    returned once its workers are warm (``warm_up``)."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    period = config.seconds("local-ray.free-objects-period")
    ray.init(
        address="local",
        num_cpus=config.get("local-ray.num-cpus"),
        object_store_memory=config.get("local-ray.object-store-memory"),
        include_dashboard=config.get("local-ray.include-dashboard"),
        logging_level=logging.WARNING,
        _system_config={"free_objects_period_milliseconds": max(1, int(period * 1000))},
    )
    logger.info("started an embedded local Ray: %s", ray.cluster_resources())
    try:
        warm = warm_up()
        # as distributed's LocalCluster returns once its workers are up: a script's
        # first compute, right after this, then runs on warm workers
        ray.wait(warm, num_returns=len(warm), timeout=config.seconds("local-ray.warm-wait"))
    except Exception as e:  # a cold start is slower, never wrong
        logger.warning("raydag: could not warm the embedded Ray's workers up: %s", e)


def warm_up() -> list[ray.ObjectRef]:
    """Start a worker process per CPU of the embedded Ray, importing in it the modules of
    ``local-ray.warm-imports`` the driver has imported, and the inbox actor. Ray starts
    worker processes only when tasks need them, and each imports dask, pandas and the
    rest on its first task (about 3.5 s here): done now, a script's first compute finds
    warm workers. Returns the tasks' refs (each gives the modules its worker imported);
    ``connect`` waits for them up to ``local-ray.warm-wait``."""
    import sys

    from raydag.runtime.inbox import inbox
    from raydag.runtime.worker import warm_worker

    wanted = [m for m in config.get("local-ray.warm-imports") or () if m in sys.modules]
    inbox()
    return [warm_worker.remote(wanted) for _ in range(int(ray.cluster_resources().get("CPU", 0)))]


# The last read of the alive nodes: (when, in ``time.monotonic()``, the Ray session, nodes).
_last_read: tuple[float, tuple[str, str], dict[str, float]] | None = None


def alive_nodes(max_age: float = 0.0) -> dict[str, float]:
    """Alive node ids and their CPUs (``ray.nodes()``: 0.3 ms on an idle embedded Ray,
    about 1.6 ms just after a compute).

    ``max_age``: the last read is good enough if it is younger than that many seconds and
    of this Ray session. A compute starts on its session's last read, however old
    (``math.inf``), and its driver loop reads afresh at once if that read is older than
    a poll, while the first tasks run, then every poll interval: that is what finds a
    death or a new node (``Runner.run``).
    """
    global _last_read
    now = time.monotonic()
    here = session()
    if max_age > 0 and _last_read is not None:
        when, where, nodes = _last_read
        if where == here and now - when < max_age:
            return dict(nodes)
    nodes = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in ray.nodes() if n["Alive"]}
    _last_read = (now, here, nodes)
    return dict(nodes)


def read_age() -> float:
    """Seconds since the last read of the alive nodes (``inf``: none yet)."""
    return math.inf if _last_read is None else time.monotonic() - _last_read[0]


def idle_cpus(alive: Mapping[str, float]) -> dict[str, float]:
    """Free CPUs of each alive node, as the cluster's control store last heard."""
    from raydag.compat import available_resources_per_node

    free = available_resources_per_node()
    return {n: float(free.get(n, {}).get("CPU", 0.0)) for n in alive}


def session() -> tuple[str, str]:
    """This Ray session: job ids restart in every new cluster, so with its GCS address."""
    ctx = ray.get_runtime_context()
    return (ctx.gcs_address, ctx.get_job_id())
