"""A multi-node Ray cluster on one machine, for fault tests.

A head with no CPUs (the driver's node, never killed) and small worker nodes, each
with its own ``TMPDIR`` so that code assuming a shared local disk fails here as it
would on separate machines. Health checks are tuned so a crash is noticed in about
1.5 s. Every process the cluster starts, raylets' workers included, is recorded by
PID and ended on exit; a killed node loses its whole process tree, as a crashed
machine would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import ray
from ray.cluster_utils import Cluster

HEALTH_CHECKS = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 1000,
    "free_objects_period_milliseconds": 20,
}


@dataclass
class Node:
    name: str
    handle: object  # ray._private.node.Node
    node_id: str
    tmpdir: str
    pids: set[int] = field(default_factory=set)
    alive: bool = True


@contextlib.contextmanager
def _ray_tmpdir(path: str) -> Iterator[None]:
    """``Cluster`` writes the head's address to ``$RAY_TMPDIR/ray/ray_current_cluster``
    (``/tmp/ray`` by default, which a fresh machine lacks and other clusters share):
    point it into this cluster's own directory while the head starts."""
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = path
    try:
        yield
    finally:
        if before is None:
            del os.environ["RAY_TMPDIR"]
        else:
            os.environ["RAY_TMPDIR"] = before


class MultiNodeCluster:
    """``with MultiNodeCluster() as c:`` connects the driver; ``c.kill(c.nodes[0])`` crashes one."""

    def __init__(
        self,
        nodes: int = 3,
        cpus: int = 1,
        store_bytes: int = 250 * 2**20,
        head_store_bytes: int = 200 * 2**20,
        system_config: dict | None = None,
    ):
        self.n_nodes = nodes
        self.cpus = cpus
        self.store_bytes = store_bytes
        self.head_store_bytes = head_store_bytes
        self.system_config = {**HEALTH_CHECKS, **(system_config or {})}
        self.nodes: list[Node] = []
        self.head: Node | None = None
        self.root = ""
        self.cluster: Cluster | None = None
        self._count = 0

    def __enter__(self) -> MultiNodeCluster:
        if ray.is_initialized():
            ray.shutdown()
        for attempt in (1, 2):  # on a loaded machine the head may miss Ray's 30 s deadline
            self.root = tempfile.mkdtemp(prefix="rdg-", dir="/tmp")
            try:
                self._start()
                return self
            except BaseException as e:
                self.__exit__(None, None, None)
                _kill_leftovers(self.root)
                if attempt == 2 or not isinstance(e, Exception):  # Ctrl-C: no retry
                    raise
        raise AssertionError("unreachable")

    def _start(self) -> None:
        self.cluster, self.head, self.nodes, self._count = None, None, [], 0
        head_tmp = self._tmpdir("head")
        with _ray_tmpdir(self.root):  # Ray writes the head's address under RAY_TMPDIR
            self.cluster = self._cluster(head_tmp)
        handle = self.cluster.head_node
        self.head = Node("head", handle, handle.node_id, head_tmp)
        for _ in range(self.n_nodes):
            self.add_node()
        ray.init(address=self.cluster.address, logging_level="WARNING")
        self._record_pids()

    def _cluster(self, head_tmp: str) -> Cluster:
        return Cluster(
            initialize_head=True,
            shutdown_at_exit=False,
            head_node_args={
                "num_cpus": 0,
                "object_store_memory": self.head_store_bytes,
                "temp_dir": os.path.join(self.root, "ray"),
                "include_dashboard": False,
                "env_vars": {"TMPDIR": head_tmp},
                "_system_config": self.system_config,
            },
        )

    def _tmpdir(self, name: str) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(path, exist_ok=True)
        return path

    def add_node(
        self, cpus: int | None = None, env_vars: dict | None = None, attempts: int = 3
    ) -> Node:
        """Start one more worker node (also usable mid-run); ``env_vars`` for its processes.

        Retried: on a loaded machine a raylet can miss Ray's fixed 30 s start deadline.
        """
        assert self.cluster is not None
        for attempt in range(1, attempts + 1):
            self._count += 1
            name = f"node{self._count}"
            tmp = self._tmpdir(name)
            try:
                handle = self.cluster.add_node(
                    num_cpus=self.cpus if cpus is None else cpus,
                    object_store_memory=self.store_bytes,
                    env_vars={**(env_vars or {}), "TMPDIR": tmp},
                    resources={name: 1},
                )
            except Exception:
                _kill_leftovers(self.root, tmp)
                if attempt == attempts:
                    raise
                continue
            node = Node(name, handle, handle.node_id, tmp)
            self.nodes.append(node)
            self._record_pids()
            return node
        raise AssertionError("unreachable")

    @property
    def alive(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def by_id(self, node_id: str) -> Node:
        return next(n for n in [self.head, *self.nodes] if n and n.node_id == node_id)

    def kill(self, node: Node) -> None:
        """Crash a node: SIGKILL its raylet, store and every worker process it started."""
        assert self.cluster is not None
        self._record_pids()
        self.cluster.remove_node(node.handle, allow_graceful=False)
        _kill(node.pids)
        node.alive = False

    def wait_dead(self, node: Node, timeout: float = 15.0) -> float:
        """Seconds until the cluster marks ``node`` dead."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if not any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
                return time.monotonic() - t0
            time.sleep(0.05)
        raise TimeoutError(f"{node.name} still alive after {timeout} s")

    def _record_pids(self) -> None:
        for node in [self.head, *self.nodes]:
            if node is None or not node.alive:
                continue
            for infos in node.handle.all_processes.values():
                for info in infos:
                    node.pids.add(info.process.pid)
            for pid in list(node.pids):
                with contextlib.suppress(psutil.Error):
                    node.pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self._record_pids()
        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
        for node in [*self.nodes, self.head]:
            if node is not None:
                _kill(node.pids)
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)


def _kill_leftovers(root: str, tmpdir: str | None = None) -> None:
    """SIGKILL what a cluster or node that failed to start left running (``__exit__``
    ends only the nodes that finished starting): every process naming the cluster's
    unique directory, or only those whose TMPDIR is the node's own directory."""
    if not root:
        return
    for pid in psutil.pids():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            env = p.environ().get("TMPDIR", "")
            node_match = tmpdir is not None and env == tmpdir
            cluster_match = tmpdir is None and (root in env or any(root in a for a in p.cmdline()))
            if node_match or cluster_match:
                p.kill()


def _kill(pids: set[int]) -> None:
    """SIGKILL every PID still alive and reap it; only our own children are waited on."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)


@contextlib.contextmanager
def multinode(**kwargs: object) -> Iterator[MultiNodeCluster]:
    with MultiNodeCluster(**kwargs) as c:  # type: ignore[arg-type]
        yield c
