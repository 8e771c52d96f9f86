"""The record of a run during which a node is killed shows the loss and the recovery.

On its own multi-node cluster (``tests/harness.py``): it shuts the shared local Ray
down, as every cluster test does.
"""

from __future__ import annotations

import os
import threading
import time

import dask
import pandas as pd
import pytest
from harness import MultiNodeCluster

import raydag
from raydag.observe.record import RunRecord

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

N_LOADS = 12


def _graph(marker_dir: str):
    # Defined here so that cloudpickle ships them by value to the cluster's workers.
    def load(i: int):
        import numpy as np
        import ray

        time.sleep(0.4)
        node = ray.get_runtime_context().get_node_id()
        open(os.path.join(marker_dir, f"{i}-{node}"), "w").close()
        return np.full(200_000, i, dtype="int64")  # 1.6 MB: lives in the node's store

    def combine(*parts):
        return int(sum(int(p.sum()) for p in parts))

    loads = [dask.delayed(load, pure=False)(i) for i in range(N_LOADS)]
    return dask.delayed(combine, pure=False)(*loads)


def _kill_after_first_result(cluster: MultiNodeCluster, marker_dir: str, killed: list) -> None:
    """Once a node has made a result (still needed: the combine waits for all), crash it."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        names = os.listdir(marker_dir)
        if names:
            node_id = names[0].split("-", 1)[1]
            time.sleep(0.3)  # its result reaches the store and the driver
            node = cluster.by_id(node_id)
            cluster.kill(node)
            killed.append(node.node_id)
            return
        time.sleep(0.02)


def test_record_shows_node_loss_and_recovery(tmp_path):
    marker_dir = tmp_path / "markers"
    marker_dir.mkdir()
    runs = tmp_path / "runs"
    killed: list = []
    with MultiNodeCluster(nodes=3, cpus=1) as cluster:
        x = _graph(str(marker_dir))
        killer = threading.Thread(
            target=_kill_after_first_result, args=(cluster, str(marker_dir), killed)
        )
        killer.start()
        with dask.config.set({"raydag.record.directory": str(runs)}):
            (total,) = dask.compute(x, scheduler=raydag.ray_get)
        killer.join()
    raydag.observe.record.flush()
    assert total == sum(i * 200_000 for i in range(N_LOADS))
    assert len(killed) == 1
    dead = killed[0]

    (run_dir,) = runs.iterdir()
    ev = pd.read_parquet(run_dir / "events.parquet")
    node_lost = ev[ev.event == "node-lost"]
    assert list(node_lost.node) == [dead]
    t_lost = node_lost.time.iloc[0]

    # the node's results were lost and recomputed in a recovery wave, elsewhere
    lost = ev[ev.event == "lost"]
    assert len(lost) >= 1 and (lost.wave >= 1).all()
    made_there = ev[(ev.event == "finished") & (ev.node == dead)]
    assert set(lost.key) <= set(made_there.key)
    recovery = ev[ev.event == "recovery"]
    assert set(lost.key) <= set(recovery.key)
    redone = ev[(ev.event == "finished") & ev.key.isin(lost.key) & (ev.wave >= 1)]
    assert set(redone.key) == set(lost.key)
    assert (redone.node != dead).all() and (redone.time > t_lost - 1.0).all()
    # every task has a finished row on a surviving node in the end
    last = ev[ev.event == "finished"].groupby("key").tail(1)
    assert len(last) == N_LOADS + 1 and (last.node != dead).all()

    summary = RunRecord.load(run_dir).summary()
    assert summary["nodes_lost"] == 1 and summary["recovery_waves"] >= 1
    assert summary["recomputed"] >= len(lost) and summary["status"] == "ok"

    # the dead node's store stops being sampled around its death
    st = pd.read_parquet(run_dir / "stores.parquet")
    assert dead in set(st.node)
    assert st[st.node == dead].time.max() <= t_lost + 1.0
    assert (st[st.node != dead].time.max()) > t_lost
