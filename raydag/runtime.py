"""The Ray layer: carry out the state machine's instructions and report what Ray did.

It holds the only references to results (``ObjectRef``s), so dropping one on a
``Release`` is what frees the object. It decides nothing: ordering, fusion, release,
retries and failure all come from ``raydag.state``.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions as rex
from dask.callbacks import local_callbacks, unpack_callbacks
from dask.sizeof import sizeof

from raydag import config
from raydag.graph import Graph
from raydag.state import (
    Aborted,
    Cancel,
    CapacityChanged,
    Fail,
    Fusion,
    Instruction,
    Release,
    State,
    Submit,
    TaskErred,
    TaskFinished,
)

logger = logging.getLogger(__name__)
Key = Hashable

# Ray errors after which the same task may well succeed: its process or node died.
RETRYABLE = (
    rex.WorkerCrashedError,
    rex.NodeDiedError,
    rex.LocalRayletDiedError,
    rex.OutOfMemoryError,
    rex.ObjectLostError,
    rex.RaySystemError,
)


# ---- the cluster ------------------------------------------------------------------


def connect() -> None:
    """Use the initialised Ray or ``RAY_ADDRESS``; otherwise start an embedded local Ray."""
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


def cluster_cpus() -> float:
    return float(ray.cluster_resources().get("CPU", 1.0))


# ---- what runs on a worker ----------------------------------------------------------


@dataclass
class Outcome:
    """What a group's Ray task tells the driver, apart from the value itself."""

    durations: list[float]
    nbytes: int = 0
    node: str = ""
    pid: int = 0
    error: bytes | None = None
    error_key: Any = None


def run_group(nodes: list, input_keys: tuple, *inputs: Any) -> tuple[Any, Outcome]:
    """Run fused dask tasks in order; return the last one's value and an Outcome."""
    values = dict(zip(input_keys, inputs))
    durations = []
    node = None
    try:
        for node in nodes:
            t0 = time.perf_counter()
            values[node.key] = node(values)
            durations.append(time.perf_counter() - t0)
    except Exception as e:  # a user's error: ship it back whole, do not let Ray retry
        return None, Outcome(durations, error=_pack_exception(e), error_key=node.key)
    result = values[nodes[-1].key]
    ctx = ray.get_runtime_context()
    return result, Outcome(durations, sizeof(result), ctx.get_node_id(), os.getpid())


_remote = ray.remote(num_returns=2, max_retries=0)(run_group)


def _pack_exception(e: BaseException) -> bytes:
    from tblib import Traceback

    tb = e.__traceback__.tb_next if e.__traceback__ else None  # drop run_group's frame
    try:
        return pickle.dumps((e, Traceback(tb).as_dict() if tb else None))
    except Exception:
        plain = RuntimeError(f"{type(e).__name__}: {e} (the exception could not be pickled)")
        return pickle.dumps((plain, Traceback(tb).as_dict() if tb else None))


def _unpack_exception(blob: bytes) -> BaseException:
    from tblib import Traceback

    exc, tb = pickle.loads(blob)
    if tb is not None:
        exc = exc.with_traceback(Traceback.from_dict(tb).as_traceback())
    return exc


def _ray_options(resources: Mapping[str, float] | None) -> dict:
    if not resources:
        return {}
    resources = dict(resources)
    opts: dict[str, Any] = {}
    for name, option in (("CPU", "num_cpus"), ("GPU", "num_gpus"), ("memory", "memory")):
        if name in resources:
            opts[option] = resources.pop(name)
    if resources:
        opts["resources"] = resources
    return opts


# ---- the driver loop ---------------------------------------------------------------


class Runner:
    """One compute: feeds Ray completions to the state machine, carries out its answers."""

    def __init__(self, graph: Graph, state: State, callbacks: Any = ()):
        self.graph = graph
        self.state = state
        self.values: dict[Key, ray.ObjectRef] = dict(graph.external)
        self.pending: dict[ray.ObjectRef, tuple[Submit, ray.ObjectRef]] = {}
        self.by_group: dict[int, ray.ObjectRef] = {}
        self.failure: Fail | None = None
        self.force_cancel = bool(config.get("cancel.force"))
        self.poll = config.seconds("scheduling.resources-poll-interval")
        self._options: dict[Any, Any] = {}
        self.callbacks = callbacks
        _, _, self.pretask, self.posttask, _ = unpack_callbacks(callbacks)
        self.dask_state = _dask_state(graph) if callbacks else None

    def run(self) -> dict[Key, ray.ObjectRef]:
        """Run to the end; return the outputs' refs (the caller owns them from here)."""
        try:
            self._carry_out(self.state.start())
            last_poll = time.monotonic()
            while not self.state.done:
                if not self.pending:
                    raise RuntimeError("raydag: nothing in flight but the graph is not done")
                ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=self.poll)
                if ready:
                    ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
                    for ref in ready:
                        self._carry_out(self.state.handle(self._event(ref)))
                        if self.state.done:
                            break
                if time.monotonic() - last_poll > self.poll:
                    last_poll = time.monotonic()
                    self._carry_out(self.state.handle(CapacityChanged(self._slots())))
            if self.failure is not None:
                exc = self.failure.error
                raise exc.with_traceback(exc.__traceback__)
            return {k: self.values[k] for k in self.graph.outputs}
        except BaseException:
            if not self.state.done:
                self._carry_out(self.state.handle(Aborted()))
            raise
        finally:
            self.values.clear()
            self.pending.clear()
            self.by_group.clear()

    def _slots(self) -> float:
        per_cpu = float(config.get("scheduling.in-flight-per-cpu"))
        return max(1.0, round(cluster_cpus() * per_cpu))

    def _event(self, meta_ref: ray.ObjectRef) -> TaskErred | TaskFinished:
        sub, value_ref = self.pending.pop(meta_ref)
        del self.by_group[sub.group]
        try:
            outcome: Outcome = ray.get(meta_ref)
        except RETRYABLE as e:
            logger.warning("task %r lost its worker (%s); may retry", sub.root, type(e).__name__)
            return TaskErred(sub.group, sub.root, e, retryable=True)
        except rex.RayTaskError as e:  # failed outside the user's code (e.g. arguments)
            cause = e.cause if isinstance(e.cause, BaseException) else e
            return TaskErred(sub.group, sub.root, cause, retryable=False)
        if outcome.error is not None:
            return TaskErred(sub.group, outcome.error_key, _unpack_exception(outcome.error))
        self.values[sub.root] = value_ref
        if self.dask_state is not None:
            self._posttask(sub, outcome)
        return TaskFinished(sub.group, dict(zip(sub.keys, outcome.durations)), outcome.nbytes)

    def _carry_out(self, instructions: list[Instruction]) -> None:
        for ins in instructions:
            if isinstance(ins, Submit):
                self._submit(ins)
            elif isinstance(ins, Release):
                self.values.pop(ins.key, None)
                if self.dask_state is not None:
                    self.dask_state["released"].add(ins.key)
            elif isinstance(ins, Cancel):
                meta_ref = self.by_group.pop(ins.group, None)
                if meta_ref is not None:
                    _, value_ref = self.pending.pop(meta_ref)
                    ray.cancel(value_ref, force=self.force_cancel)
            elif isinstance(ins, Fail):
                self.failure = ins

    def _submit(self, sub: Submit) -> None:
        fn = self._options.get(sub.resources and tuple(sorted(sub.resources.items())))
        if fn is None:
            fn = _remote.options(**_ray_options(sub.resources)) if sub.resources else _remote
            self._options[sub.resources and tuple(sorted(sub.resources.items()))] = fn
        nodes = [self.graph.tasks[k] for k in sub.keys]
        value_ref, meta_ref = fn.remote(nodes, sub.inputs, *[self.values[k] for k in sub.inputs])
        self.pending[meta_ref] = (sub, value_ref)
        self.by_group[sub.group] = meta_ref
        if self.dask_state is not None:
            s = self.dask_state
            for k in sub.keys:
                s["waiting"].discard(k)
                s["running"].add(k)
                for f in self.pretask:
                    f(k, self.graph.tasks, s)

    def _posttask(self, sub: Submit, outcome: Outcome) -> None:
        s = self.dask_state
        for k in sub.keys:
            s["running"].discard(k)
            s["finished"].add(k)
            for f in self.posttask:
                f(k, None, self.graph.tasks, s, outcome.pid)


def _dask_state(graph: Graph) -> dict:
    """The subset of dask.local's state dict that dask's callbacks read."""
    return {
        "dependencies": {k: set(v) for k, v in graph.dependencies.items()},
        "dependents": graph.dependents,
        "waiting": set(graph.tasks) - set(graph.external),
        "ready": set(),
        "running": set(),
        "finished": set(graph.external),
        "released": set(),
        "cache": {},
    }


# ---- entry points ------------------------------------------------------------------


def fusion_settings() -> Fusion:
    return Fusion(
        enabled=bool(config.get("fusion.enabled")),
        max_task_duration=config.seconds("fusion.max-task-duration"),
        max_group_duration=config.seconds("fusion.max-group-duration"),
        max_group_size=int(config.get("fusion.max-group-size")),
    )


def run(dsk: Any, keys: Any, callbacks: Any = None) -> tuple[Graph, dict[Key, ray.ObjectRef]]:
    """Build the graph, run it on Ray, return the outputs' refs."""
    graph = Graph.from_dask(dsk, keys, is_external=lambda v: isinstance(v, ray.ObjectRef))
    connect()
    per_cpu = float(config.get("scheduling.in-flight-per-cpu"))
    state = State.from_graph(
        graph,
        capacity=max(1.0, round(cluster_cpus() * per_cpu)),
        default_retries=int(config.get("retries")),
        fusion=fusion_settings(),
    )
    with local_callbacks(callbacks) as cbs:
        started = []
        failed = True
        runner = Runner(graph, state, cbs)
        try:
            for cb in cbs:
                if cb[0]:
                    cb[0](graph.tasks)
                started.append(cb)
            for cb in cbs:
                if cb[1]:
                    cb[1](graph.tasks, runner.dask_state)
            refs = runner.run()
            failed = False
            return graph, refs
        finally:
            for cb in started:
                if cb[4]:
                    cb[4](graph.tasks, runner.dask_state or {}, failed)


def nested(keys: Any, values: Mapping[Key, Any]) -> Any:
    if isinstance(keys, list):
        return [nested(k, values) for k in keys]
    return values[keys]

