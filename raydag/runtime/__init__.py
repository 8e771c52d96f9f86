"""The Ray layer: reports facts to the state machine and carries out its instructions.

``run`` is the one entry point: build the graph, connect, build the state machine from
the settings, watch it (run record, progress, store sampler) and drive it with a
``Runner`` to the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

import dask
import ray
from dask.callbacks import local_callbacks

from raydag import config
from raydag.compat import validate_task_options
from raydag.core import bundles
from raydag.core.checkpoints import Checkpoints
from raydag.core.events import Event, Instruction
from raydag.core.fusion import Fusion
from raydag.core.graph import HANDLED_ANNOTATIONS, Graph, UnknownAnnotationWarning
from raydag.core.options import task_options
from raydag.core.placement import Placement
from raydag.core.recovery import Recovery
from raydag.core.speculation import Speculation
from raydag.core.state import State, slots
from raydag.observe import progress, record
from raydag.runtime.cluster import INLINE_BYTES, INLINE_TOTAL, alive_nodes, connect
from raydag.runtime.graveyard import hold_until_ended
from raydag.runtime.inbox import cancel
from raydag.runtime.persisted import Persisted, find_persisted, gone, is_given
from raydag.runtime.ray_hooks import RayHooks, nested
from raydag.runtime.runner import Runner, frameless
from raydag.runtime.stores import StoreSampler, shared_reader
from raydag.runtime.worker import pack_exception, unpack_exception

logger = logging.getLogger("raydag.runtime")
Key = Hashable

__all__ = [
    "Persisted",
    "RayHooks",
    "cancel",
    "connect",
    "frameless",
    "hold_until_ended",
    "nested",
    "pack_exception",
    "run",
    "unpack_exception",
]


def seed_runtimes() -> dict[str, list[float]] | None:
    """Runtimes per category from ``raydag.speculation.seed``: a run directory or record."""
    seed = config.get("speculation.seed")
    if seed is None:
        return None
    try:
        rec = seed if isinstance(seed, record.RunRecord) else record.load(os.path.expanduser(seed))
        return record.category_runtimes(rec)
    except Exception as e:  # a missing or unreadable record must not stop the compute
        logger.warning("raydag: cannot seed runtimes from %r: %s", seed, e)
        return None


def run(
    dsk: Any,
    keys: Any,
    callbacks: Any = None,
    ray_remote_args: Mapping[str, Any] | None = None,
    hooks: RayHooks | None = None,
) -> tuple[Graph, dict[Key, tuple[ray.ObjectRef, str | None]]]:
    """Build the graph, run it on Ray, return the outputs' refs and nodes.

    ``ray_remote_args``: Ray task options for every task (``raydag.core.options``);
    ``hooks``: Ray's ``RayDaskCallback`` hooks (``ray_hooks``). A presubmit hook turns
    fusion and bundles off: it may give any one dask task's value in its place.
    """
    graph = Graph.from_dask(
        dsk,
        keys,
        is_external=is_given,
        find_external=find_persisted,
        around=dask.get_annotations(),
        order_later_above=config.get("scheduling.order-later-above"),
    )
    options = task_options(
        graph.tasks, graph.annotations, ray_remote_args, validate=validate_task_options
    )
    unknown = graph.unknown_annotations()
    if unknown:
        warnings.warn(
            f"raydag ignores annotations that no scheduler reads: {', '.join(unknown)} "
            f"(raydag reads {' and '.join(sorted(HANDLED_ANNOTATIONS))})",
            UnknownAnnotationWarning,
            stacklevel=3,
        )
    connect()
    # as this session last saw them: the driver loop looks again at once if that is old
    nodes = alive_nodes(max_age=math.inf)
    per_cpu = float(config.get("scheduling.in-flight-per-cpu"))
    speculation = Speculation.from_config()
    checkpoints, checkpointing, found = _checkpoints(graph)
    fusion = Fusion.from_config()
    one_by_one = hooks is not None and bool(hooks.presubmit)
    if one_by_one:
        fusion = dataclasses.replace(fusion, enabled=False)
    state = State.from_graph(
        graph,
        options,
        bundles=None if one_by_one else bundles.find(graph.tasks, graph.dependents),
        capacity=slots(sum(nodes.values()), per_cpu),
        nodes=nodes,
        in_flight_per_cpu=per_cpu,
        default_retries=int(config.get("retries")),
        fusion=fusion,
        cheap_cost=float(config.get("scheduling.cheap-task-cost")),
        speculation=speculation,
        seed_runtimes=seed_runtimes() if speculation.enabled else None,
        placement=Placement.from_config(),
        recovery=Recovery.from_config(),
        inline_bytes=INLINE_BYTES,
        inline_total=INLINE_TOTAL,
        gone=gone(graph.external),
        checkpoints=checkpoints,
        checkpointed=found,
    )
    with (
        local_callbacks(callbacks) as cbs,
        _watching(graph, state, nodes, cbs) as (observers, sampler),
    ):
        started = []
        failed = True
        runner = Runner(graph, state, nodes, cbs, observers, sampler, checkpointing, hooks)
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


def _checkpoints(graph: Graph) -> tuple[Checkpoints | None, Any, set]:
    """Checkpoints' settings, the store (``None``: off, or it cannot be used) and the
    keys of this graph it holds."""
    settings = Checkpoints.from_config()
    if not settings.enabled:
        return None, None, set()
    from raydag.runtime import checkpoints

    names = checkpoints.names(graph.tasks, graph.dependencies)
    store, found, partial = checkpoints.open_store(settings.store, names, settings.resume)
    if store is None:
        return None, None, set()
    return settings, checkpoints.Checkpointing(store, names, partial), found


@contextlib.contextmanager
def _watching(
    graph: Graph, state: State, nodes: dict[str, float], callbacks: Any
) -> Iterator[tuple[list[Callable[[Event | None, list[Instruction]], None]], Any]]:
    """The compute's observers: its run record and progress display; and the
    object-store sampler, whose rounds they show and placement reads (only when
    written, displayed or placing)."""
    keep, sample = record.wanted(len(graph))
    recorder = (
        record.Recorder(graph, nodes, alive_nodes, capacity=lambda: state.capacity)
        if keep
        else None
    )
    display = progress.start(state, callbacks)
    sampler = None
    placing = state.placer.settings.enabled
    if sample or display is not None or placing:
        # For placement alone the sampler starts at the driver loop's first poll
        # (``Runner._tick``): a compute shorter than that would never read a round.
        eager = bool(sample or display is not None)
        try:
            interval = min(
                config.seconds("record.store-interval") if sample or display else math.inf,
                config.seconds("placement.interval") if placing else math.inf,
            )
            on_round = display.stores if display is not None else None
            keeping = bool(sample or display is not None)  # placement needs only the latest
            sampler = StoreSampler(
                interval, on_round=on_round, reader=shared_reader(), keep=keeping
            )
            if eager:
                sampler.start(wait=False)  # the first round in its thread: the compute goes on
        except Exception as e:  # the record goes on without store samples
            logger.warning("raydag: cannot sample the object stores: %s", e)
            sampler = None
    error = None
    try:
        yield [o for o in (recorder, display) if o is not None], sampler
    except BaseException as e:
        error = e
        raise
    finally:
        if recorder is not None:
            recorder.stop()
        if sampler is not None:
            with contextlib.suppress(Exception):
                sampler.stop()
        if display is not None:
            display.close(error)
        if recorder is not None:
            if sampler is not None:
                recorder.add_samples(sampler.samples)
            try:
                record.finished(recorder.finish(error))
            except Exception:  # the record must never break a compute
                logger.exception("raydag: could not finish the run record")
