"""How full each node's object store is, read straight from the raylets.

Ray's placement ignores object-store fullness and ``ray.available_resources()`` does
not track real usage, so raydag asks each raylet itself (``GetNodeStats``, about 1 to
2 ms per node) instead. No dashboard is needed: the state API would cost about 0.9 GB
more and may reach another cluster's dashboard on a shared machine.

``store_stats()`` reads every alive node once; ``StoreSampler`` does so in a thread
every ``interval`` seconds and keeps the samples and the peaks, for benchmarks, tests
and a compute's run record.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import ray

from raydag import compat

logger = logging.getLogger(__name__)

NodeId = str  # a node's id in hex, as ``ray.nodes()[i]["NodeID"]``


@dataclass(frozen=True)
class StoreStats:
    """One node's object store at one moment (fields of Ray's ``ObjectStoreStats``)."""

    used_bytes: int  # object_store_bytes_used: bytes held in shared memory now
    capacity_bytes: int  # object_store_bytes_avail: the store's size (not what is free)
    # spilled_bytes_total: cumulative since the node started, not what is on disk now
    spilled_bytes: int
    num_objects: int  # num_local_objects
    primary_bytes: int = 0  # object_store_bytes_primary_copy: owned copies, not evictable
    fallback_bytes: int = 0  # object_store_bytes_fallback: overflow mmapped from disk
    primary_objects: int = 0  # num_object_store_primary_copies: not the evictable caches

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    @property
    def fraction_used(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @classmethod
    def from_proto(cls, s: Any) -> StoreStats:
        return cls(
            used_bytes=int(s.object_store_bytes_used),
            capacity_bytes=int(s.object_store_bytes_avail),
            spilled_bytes=int(s.spilled_bytes_total),
            num_objects=int(s.num_local_objects),
            primary_bytes=int(s.object_store_bytes_primary_copy),
            fallback_bytes=int(s.object_store_bytes_fallback),
            primary_objects=int(s.num_object_store_primary_copies),
        )


class StoreReader:
    """Reads all alive raylets' store stats, keeping one gRPC channel per raylet.

    ``ray._private.internal_api.node_stats`` opens a new channel on every call; this
    keeps them, so a poll costs one RPC per node. Channels come from Ray's own
    ``init_grpc_channel``, which adds the token-authentication metadata (on by default
    for local clusters since Ray 2.59) and TLS when Ray is configured for it. The RPCs
    to all nodes are issued together, so a poll takes about as long as the slowest node.
    Needs ``ray.init()`` in this process (for ``ray.nodes()`` and the token).
    """

    def __init__(self, timeout: float = 2.0) -> None:
        self.timeout = timeout
        self._lock = threading.Lock()
        # node id -> (raylet address, channel, stub)
        self._stubs: dict[NodeId, tuple[str, Any, Any]] = {}
        # Nodes whose last read failed: warn once, not every poll. A crashed node stays
        # "alive" in ray.nodes() until the GCS notices (about 15 s by default). Their
        # channels are kept: gRPC reconnects by itself and fails fast meanwhile.
        self._failing: set[NodeId] = set()

    def read(self) -> dict[NodeId, StoreStats]:
        """Stats of every alive node that answered within ``timeout``; others are logged."""
        request = compat.node_stats_request()
        if request is None:  # this Ray's raylet API is not one raydag knows: said once
            return {}
        alive = {
            n["NodeID"]: f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}"
            for n in ray.nodes()
            if n.get("Alive")
        }
        with self._lock:
            self._forget(set(self._stubs) - set(alive))
            futures = {
                node: self._stub(node, address).GetNodeStats.future(request, timeout=self.timeout)
                for node, address in alive.items()
            }
        out: dict[NodeId, StoreStats] = {}
        errors: dict[NodeId, BaseException] = {}
        for node, future in futures.items():
            try:
                out[node] = StoreStats.from_proto(future.result().store_stats)
            except Exception as e:  # a dying node, a timeout: skip it this time
                errors[node] = e
        with self._lock:
            for node, e in errors.items():
                level = logging.DEBUG if node in self._failing else logging.WARNING
                logger.log(level, "no store stats from node %s: %s", node[:8], _describe(e))
            for node in self._failing & set(out):
                logger.info("store stats from node %s again", node[:8])
            self._failing = set(errors)
        return out

    def close(self) -> None:
        with self._lock:
            self._forget(set(self._stubs))

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stub(self, node: NodeId, address: str) -> Any:
        known = self._stubs.get(node)
        if known is not None and known[0] == address:
            return known[2]
        self._forget({node})
        channel, stub = compat.raylet_stub(address)
        self._stubs[node] = (address, channel, stub)
        logger.debug("opened a store-stats channel to node %s at %s", node[:8], address)
        return stub

    def _forget(self, nodes: set[NodeId]) -> None:
        for node in nodes:
            known = self._stubs.pop(node, None)
            if known is not None:
                known[1].close()


def _describe(e: BaseException) -> str:
    code = getattr(e, "code", None)
    if callable(code):  # a grpc.RpcError
        return f"{code()}: {e.details()}"  # type: ignore[attr-defined]
    return f"{type(e).__name__}: {e}"


_default_reader: StoreReader | None = None
_default_lock = threading.Lock()


def shared_reader(timeout: float = 2.0) -> StoreReader:
    """The process's reader: its channels outlive a compute, so a sampler starts fast."""
    global _default_reader
    with _default_lock:
        if _default_reader is None:
            _default_reader = StoreReader(timeout)
        return _default_reader


def store_stats(timeout: float = 2.0) -> dict[NodeId, StoreStats]:
    """Each alive node's object store now, by node id (hex); reuses one shared reader."""
    reader = shared_reader(timeout)
    reader.timeout = timeout
    return reader.read()


@dataclass(frozen=True)
class Sample:
    """One node's store in one sampling round; ``time`` is ``time.monotonic()``."""

    time: float
    node: NodeId
    used_bytes: int
    capacity_bytes: int
    spilled_bytes: int
    num_objects: int
    primary_bytes: int = 0  # pinned copies: what the store cannot evict


class StoreSampler:
    """Samples all nodes' object stores in a daemon thread every ``interval`` seconds.

    A context manager: it samples once on entry and once on exit, so even a short
    block has a before and after (on exit only if it ``keep``s every round: one that
    keeps the latest alone is read while running). All nodes of one round share that round's start
    time; ``peak_total_used`` is the largest per-round sum over nodes, which is what
    the cluster as a whole had to hold. The raylet frees released objects in batches
    (``free_objects_period_milliseconds``), so short peaks between two samples can be
    missed: sample faster than that period to see them.
    """

    def __init__(
        self,
        interval: float = 0.5,
        timeout: float = 2.0,
        on_round: Callable[[float, dict[NodeId, StoreStats]], None] | None = None,
        reader: StoreReader | None = None,
        keep: bool = True,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.interval = interval
        self.samples: list[Sample] = []
        self.keep = keep  # keep every round's samples (else only the latest and peaks)
        self.peak_total_used = 0
        self.peak_total_time: float | None = None
        self.peak_used: dict[NodeId, int] = {}
        self.rounds = 0
        self.latest: dict[NodeId, StoreStats] = {}  # the last round's stats
        self._totals: list[tuple[float, int]] = []
        self._on_round = on_round
        # A given reader (e.g. ``shared_reader()``) is someone else's: not closed here.
        self._own_reader = reader is None
        self._reader = StoreReader(timeout) if reader is None else reader
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._lock = threading.Lock()

    def start(self, wait: bool = True) -> StoreSampler:
        """Take the first round (here, or at once in the thread if not ``wait``) and go on."""
        if self._started:
            raise RuntimeError("a StoreSampler runs once: make a new one")
        self._started = True
        if wait:
            self.sample()
        self._thread = threading.Thread(
            target=self._loop, args=(not wait,), name="raydag-store-sampler", daemon=True
        )
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._started

    def stop(self) -> None:
        """Stop the thread; one last round if it keeps every round (the "after").

        A sampler that keeps only the latest round (placement's) with a reader it does
        not own has nothing to do at the end: it does not wait for a round in flight,
        whose store read can take up to the reader's timeout, to end the compute.
        """
        if self._thread is None:
            return
        self._stop.set()
        if self.keep or self._own_reader:
            self._thread.join()
        self._thread = None
        try:
            if self.keep:
                self.sample()
        finally:
            if self._own_reader:
                self._reader.close()

    def __enter__(self) -> StoreSampler:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def sample(self) -> dict[NodeId, StoreStats]:
        """Take one round now (the thread calls this too); returns what it read."""
        t = time.monotonic()
        stats = self._reader.read()
        with self._lock:
            self.rounds += 1
            self.latest = stats
            total = 0
            for node, s in stats.items():
                if self.keep:
                    self.samples.append(
                        Sample(
                            t,
                            node,
                            s.used_bytes,
                            s.capacity_bytes,
                            s.spilled_bytes,
                            s.num_objects,
                            s.primary_bytes,
                        )
                    )
                total += s.used_bytes
                if s.used_bytes > self.peak_used.get(node, -1):
                    self.peak_used[node] = s.used_bytes
            self._totals.append((t, total))
            if total > self.peak_total_used or self.peak_total_time is None:
                self.peak_total_used = total
                self.peak_total_time = t
        if self._on_round is not None:
            self._on_round(t, stats)
        return stats

    def totals(self) -> list[tuple[float, int]]:
        """Per round, in order: (time, used bytes summed over the nodes that answered)."""
        with self._lock:
            return list(self._totals)

    def _loop(self, first: bool = False) -> None:
        next_at = time.monotonic() + (0.0 if first else self.interval)
        failed = False
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.interval
            now = time.monotonic()
            if next_at < now:  # fell behind (slow RPCs, busy machine): skip, don't burst
                next_at = now + self.interval
            try:
                self.sample()
                failed = False
            except Exception:
                if not failed and not self._stop.is_set():  # not a read cut short by the end
                    logger.exception("store sampling failed; will keep trying")
                failed = True
