"""The driver loop: report what Ray did to the state machine, carry out what it decides.

The Ray layer decides nothing. It holds the only references to results (``ObjectRef``s),
so dropping one on a ``Release`` is what frees the object; it turns what Ray says (a
task's outcome, Ray's error for it, the cluster's nodes, the inbox's start notes, the
object stores) into events (``raydag.core.events``), and each instruction into Ray calls.
What a death lost, what is retried or recomputed, which node is taken for dead: all of
it is ``raydag.core.state``'s.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import ray
import ray.exceptions as rex
from dask.callbacks import unpack_callbacks
from dask.sizeof import sizeof

from raydag import config
from raydag.compat import DataNode, node_affinity
from raydag.core.events import (
    Aborted,
    Cancel,
    Checkpoint,
    CheckpointIgnored,
    CheckpointsOff,
    CpusChanged,
    DropCheckpoints,
    Event,
    Fail,
    InputLost,
    Instruction,
    NodeDied,
    NodeTakenDead,
    Ordered,
    Recover,
    Release,
    RemoveCheckpoints,
    StoresSampled,
    Submit,
    TaskErred,
    TaskFinished,
    TaskStarted,
    Tick,
    Won,
)
from raydag.core.graph import Graph
from raydag.core.records import READY, WAITING
from raydag.core.state import State
from raydag.runtime.cluster import alive_nodes, idle_cpus, read_age
from raydag.runtime.graveyard import graveyard
from raydag.runtime.inbox import cancel, inbox
from raydag.runtime.persisted import Persisted, given_ref, handed_out
from raydag.runtime.ray_hooks import RayHooks
from raydag.runtime.stores import StoreSampler
from raydag.runtime.worker import (
    Outcome,
    Shipper,
    ray_options,
    remote_group,
    spare_worker,
    unpack_exception,
    warn_again,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from raydag.runtime.checkpoints import Checkpointing

logger = logging.getLogger("raydag.runtime")
Key = Hashable

# How a Ray task can fail without the user's code raising, by what it means.
NODE_DIED = (rex.NodeDiedError, rex.LocalRayletDiedError)
WORKER_DIED = (rex.WorkerCrashedError, rex.OutOfMemoryError, rex.RaySystemError)
INPUT_LOST = (rex.ObjectLostError, rex.ObjectFetchTimedOutError)

_runs = itertools.count(1)


class Runner:
    """One compute: feeds Ray completions to the state machine, carries out its answers."""

    def __init__(
        self,
        graph: Graph,
        state: State,
        nodes: dict[str, float],
        callbacks: Any = (),
        observers: Sequence[Callable[[Event | None, list[Instruction]], None]] = (),
        sampler: StoreSampler | None = None,
        checkpoints: Checkpointing | None = None,
        hooks: RayHooks | None = None,
    ):
        self.graph = graph
        self.state = state
        # Called with every event (None for the start) and the instructions it gave:
        # the state machine's transcript, for the run record and progress displays.
        self.observers = list(observers)
        # Refs this compute produced; values given from outside are read from the graph.
        self.values = {k: given_ref(v) for k, v in graph.external.items()}
        self.alive = dict(nodes)  # the cluster's alive nodes and CPUs, as last read
        self.pending: dict[ray.ObjectRef, tuple[Submit, tuple]] = {}  # by outcome ref
        self.by_copy: dict[int, ray.ObjectRef] = {}
        self.failure: Fail | None = None
        self.force_cancel = bool(config.get("cancel.force"))
        self.poll = config.seconds("scheduling.cluster-poll-interval")
        self.ray_retries = int(config.get("retries")) if state.recoverer.settings.ray_first else 0
        self._options: dict[Any, Any] = {}
        self._shipper = Shipper()  # shared callables, shipped once per compute
        # the object stores, sampled in a thread: placement reads each new round
        self.sampler = sampler if state.placer.settings.enabled else None
        self._round = 0
        self.run_id = next(_runs)
        self._inbox: Any = None
        self._drain: ray.ObjectRef | None = None
        self._notes_after = 0.0  # the longest a start note waits in its worker
        # Refs whose Ray task ended, as Ray's callbacks say (``_watch``): the loop waits
        # on this queue, not on every ref in flight, so a loop costs what ended in it.
        self._ended: queue.SimpleQueue[Any] = queue.SimpleQueue()
        _, _, self.pretask, self.posttask, _ = unpack_callbacks(callbacks)
        self.dask_state = _dask_state(graph) if callbacks else None
        self.checkpoints = checkpoints  # the writes in flight, the reads back
        # Ray's RayDaskCallback hooks (ray_hooks): the keys not submitted yet and the
        # outputs' refs since, for postsubmit_all (None: no such hook, or called)
        self.hooks = hooks
        self._unsubmitted: set | None = None
        self._awaiting_all = bool(hooks is not None and hooks.postsubmit_all)
        self._output_refs: dict[Key, ray.ObjectRef] = {}

    def run(self) -> dict[Key, tuple[ray.ObjectRef, str | None]]:
        """Run to the end; return the outputs' refs and nodes (the caller owns them now)."""
        try:
            self._step(None)
            if not self.graph.ordered:
                self._order_in_background()
            if self._awaiting_all:
                tasks = self.state.tasks
                self._unsubmitted = {k for k, ts in tasks.items() if ts.state in (WAITING, READY)}
                self._all_submitted()
            if not self.state.done and read_age() > self.poll:  # an old read: ``runtime.run``
                self._watch_cluster()  # the first tasks run meanwhile
            last_poll = time.monotonic()
            while not self.state.done:
                if not self.pending:
                    raise RuntimeError("raydag: nothing in flight but the graph is not done")
                self._wait_and_handle()
                if time.monotonic() - last_poll > self.poll:
                    last_poll = time.monotonic()
                    self._tick()
                    self._watch_cluster()
            if self.failure is not None:
                exc = self.failure.error
                raise exc.with_traceback(exc.__traceback__)
            if self.checkpoints is not None:
                self.checkpoints.settle()
            if self._awaiting_all:  # never all submitted at once: all given, or done
                self._unsubmitted = set()
                self._all_submitted()
            tasks = self.state.tasks
            return {k: (self._ref(k), tasks[k].node) for k in self.graph.outputs}
        except BaseException:
            if not self.state.done:
                self._step(Aborted())
            raise
        finally:
            self.values.clear()
            for meta_ref, (_, value_refs) in self.pending.items():  # none, unless interrupted
                graveyard.hold(meta_ref, value_refs)
            self.pending.clear()
            self.by_copy.clear()
            self._output_refs.clear()
            self._drain = None
            self._ended = queue.SimpleQueue()  # callbacks still to come go to a dropped one
            self._shipper = Shipper()  # its refs free the shared callables
            if self.checkpoints is not None:
                self.checkpoints.close()  # its writers end after their writes

    def _order_in_background(self) -> None:
        """``dask.order`` of the whole graph in a thread while the compute starts on the
        provisional order; its priorities come through the queue the loop waits on, as
        an event (``Ordered``). A compute that ends first drops them."""
        ended, graph = self._ended, self.graph

        def order() -> None:
            try:
                ended.put(Ordered(graph.order()))  # type: ignore[arg-type]
            except Exception as e:  # the provisional order stays; the compute goes on
                logger.warning("raydag: dask.order failed, keeping a depth-first order: %r", e)

        threading.Thread(target=order, name="raydag-order", daemon=True).start()

    def _watch(self, ref: ray.ObjectRef) -> None:
        """Have Ray say when ``ref``'s task ends: it puts ``(ref, value, error)`` in
        ``_ended``. Ray's callback has read the object by then (an Outcome is small):
        the loop takes it from there, not from a second ``ray.get``. Not the future
        itself: it holds this callback, which holds the queue, a cycle that only the
        garbage collector would free (with the refs in it) once the queue is dropped."""
        ended = self._ended

        def put(done: Future, ref: ray.ObjectRef = ref) -> None:
            error = done.exception()
            ended.put((ref, None if error is not None else done.result(), error))

        ref.future().add_done_callback(put)

    def _wait_and_handle(self) -> None:
        """Wait for Ray tasks to end (up to a poll interval); step through what they
        mean. The refs stay in this frame, not in ``run``'s: a raised error keeps
        the frames it passed through, with their locals, for as long as it lives."""
        # the inbox's drain too: a start note wakes the loop (see ``Inbox``)
        writes = self.checkpoints.writes if self.checkpoints is not None else {}
        try:
            items = [self._ended.get(timeout=self.poll)]
        except queue.Empty:
            return
        while not self._ended.empty():  # and every other one ended by now
            items.append(self._ended.get_nowait())
        for item in items:
            if type(item) is Ordered:  # dask.order's priorities (``_order_in_background``)
                self._step(item, quiet=True)
                continue
            ref, value, error = item
            if self._drain is not None and ref == self._drain:
                self._take_notes(wait=0)
                continue
            if ref in writes:  # a checkpoint written, or not
                self._step(self.checkpoints.ended(ref))  # type: ignore[union-attr]
                continue
            if ref not in self.pending:  # cancelled while handling an earlier one
                continue
            for event in self._events(ref, (value, error)):
                self._step(event)
            if self.state.done:
                break

    def _step(self, event: Event | None, quiet: bool = False) -> None:
        """One transition: the event in (``None`` to start), its instructions out.

        ``quiet``: observers see the event only if it gave instructions (a Tick that
        changed nothing is not worth a row, four times a second).
        """
        instructions = self.state.start() if event is None else self.state.handle(event)
        if instructions or not quiet:
            for observe in self.observers:
                observe(event, instructions)
        self._carry_out(instructions)

    # ---- facts in ------------------------------------------------------------------

    def _watch_cluster(self) -> None:
        """Report nodes that died and a changed CPU count.

        Before a death, the facts that came before it: every start note sent so far
        (a running copy holds its inputs), and the copies that finished well meanwhile
        (they have read their inputs and made their values). A failure may be the
        death's consequence: it is reported after the death, by the main loop.
        """
        nodes = alive_nodes()
        dead = sorted(set(self.alive) - set(nodes))
        changed = nodes != self.alive
        self.alive = nodes
        if dead:
            # every note of a copy started before now is sent by then (its thread's
            # wake-up and send take well under the wait again)
            time.sleep(2 * self._notes_after)
            self._take_notes(wait=2.0)
            self._report_finished()
        for node in dead:
            logger.warning("raydag: node %s died", node[:12])
            self._step(NodeDied(node, f"node died: {node[:12]}"))
        if changed:
            logger.debug(
                "raydag: alive nodes and CPUs now %s", {n[:8]: c for n, c in nodes.items()}
            )
            self._step(CpusChanged(sum(nodes.values())))

    def _report_finished(self) -> None:
        if not self.pending:
            return
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        for ref in ready:
            if ref not in self.pending:
                continue
            try:
                outcome = ray.get(ref, timeout=0)
            except Exception as e:
                frameless(e)
                continue
            if getattr(outcome, "error", True) is not None:
                continue
            for event in self._events(ref):
                self._step(event)

    def _tick(self) -> None:
        """Report which copies started where, the time, the stores and the idle CPUs."""
        if self.state.done:
            return
        self._take_notes(wait=0)
        alive = {n: c for n, c in self.alive.items() if self.state.is_alive(n)}
        idle = None
        if self.sampler is not None and not self.sampler.started:
            self.sampler.start(wait=False)  # placement's: started by the first poll
        elif self.sampler is not None and self.sampler.rounds != self._round:
            self._round = self.sampler.rounds
            stats = self.sampler.latest
            # Pinned (primary) copies only: Ray evicts cached copies of others' values as
            # it needs room, and spills primaries past its threshold. Nodes that can run
            # tasks only: a head without CPUs holds values but runs nothing.
            stores = {
                n: (s.primary_bytes, s.capacity_bytes) for n, s in stats.items() if alive.get(n)
            }
            idle = idle_cpus(alive)
            self._step(StoresSampled(stores, idle), quiet=True)
        if self.state.speculator.enabled:
            self._step(Tick(time.time(), idle or idle_cpus(alive)), quiet=True)

    def _take_notes(self, wait: float) -> None:
        """Pass on the start notes the inbox holds; ask for the next ones. With ``wait``,
        every note sent so far (a node died: who holds which inputs matters)."""
        if self._inbox is None:
            return
        if self._drain is not None:
            self._collect(wait + self.poll if wait else 0)
        if wait and self._drain is None:  # the inbox answers in order: ask once more
            self._drain = self._inbox.drain.remote(self.run_id)
            self._watch(self._drain)
            self._collect(wait)
        if self._drain is None:  # held at the inbox until a note comes: see ``Inbox``
            self._drain = self._inbox.drain.remote(self.run_id, self.poll)
            self._watch(self._drain)

    def _collect(self, wait: float) -> None:
        ready, _ = ray.wait([self._drain], timeout=wait)
        if not ready:
            return
        try:
            notes = ray.get(self._drain)
        except ray.exceptions.RayError as e:  # the inbox restarts; notes are lost
            logger.warning("raydag: the inbox of start notes failed: %s", frameless(e))
            notes = []
        self._drain = None
        for run, copy, node, t in notes:
            if run == self.run_id and copy in self.by_copy:
                self._step(TaskStarted(copy, node, t))

    def _events(self, meta_ref: ray.ObjectRef, read: tuple | None = None) -> list:
        """What one finished Ray task means, as state machine events (``read``: its
        outcome and Ray's error, as ``_watch`` has them)."""
        sub, value_refs = self.pending.pop(meta_ref)
        del self.by_copy[sub.copy]
        outcome = _outcome(meta_ref, value_refs, read)
        if isinstance(outcome, Exception):
            return self._ray_erred(sub, outcome)
        if outcome.warnings is not None:
            try:
                warn_again(outcome.warnings)
            except Warning as e:  # the driver's filters make it an error: the task's
                return [TaskErred(sub.copy, sub.root, e)]  # error, as under dask's own
        if outcome.error is not None:
            return [TaskErred(sub.copy, outcome.error_key, unpack_exception(outcome.error))]
        for k, ref in zip(sub.kept, value_refs, strict=True):
            self.values[k] = ref
            given = self.graph.external.get(k)
            if isinstance(given, Persisted):  # recomputed after a loss: heal the collection
                given.heal(ref, outcome.node)
        if self.dask_state is not None:
            self._posttask(sub, outcome)
        durations = dict(zip(sub.keys, outcome.durations, strict=True))
        sizes = outcome.sizes or [outcome.nbytes]
        return [
            TaskFinished(
                sub.copy,
                durations,
                outcome.nbytes,
                outcome.node,
                outcome.started,
                outcome.pid,
                tuple(sizes) if len(sub.kept) > 1 else (),
            )
        ]

    def _ray_erred(self, sub: Submit, e: Exception) -> list:
        """What Ray's error for a Ray task says happened (the user's own errors come in
        its Outcome): a node or a worker process died, an input is gone, or the task
        could not run at all."""
        if isinstance(e, rex.TaskUnschedulableError):  # a duplicate's node died before it ran
            logger.warning("raydag: the node for a copy of %r is gone", sub.root)
            return [TaskErred(sub.copy, sub.root, e, node_died=True)]
        if isinstance(e, NODE_DIED):
            logger.warning("raydag: the node running %r died%s", sub.root, _with(sub))
            self._watch_cluster()  # the death, reported before what it did to this copy
            return [TaskErred(sub.copy, sub.root, e, node_died=True)]
        if isinstance(e, WORKER_DIED):
            if isinstance(e, rex.RayTaskError):  # e.g. RaySystemError: cannot unpickle the
                cause = e.cause if isinstance(e.cause, BaseException) else e  # task: no retry
                return [TaskErred(sub.copy, sub.root, cause)]
            logger.warning(
                "raydag: %r lost its worker process (%s)%s", sub.root, type(e).__name__, _with(sub)
            )
            return [TaskErred(sub.copy, sub.root, e, worker_died=True)]
        if isinstance(e, INPUT_LOST):
            logger.warning("raydag: an input of %r is lost (%s)", sub.root, type(e).__name__)
            self._watch_cluster()
            return [InputLost(sub.copy, self._gone(sub, e), f"input of {sub.root!r} lost")]
        if isinstance(e, rex.RayTaskError):  # failed outside the user's code (e.g. arguments)
            cause = e.cause if isinstance(e.cause, BaseException) else e
            return [TaskErred(sub.copy, sub.root, cause)]
        raise e

    def _gone(self, sub: Submit, e: Exception) -> tuple:
        """The inputs of ``sub`` whose values Ray no longer has: the one its error names
        (the error Ray stores in place of a lost object is copied to its readers, so
        its word beats the locations), and given values of unknown node with no copy
        on an alive node."""
        named = getattr(getattr(e, "cause", None) or e, "object_ref_hex", None)
        gone = [k for k in sub.inputs if named and self._hex(k) == named]
        tasks = self.state.tasks
        unplaced = [k for k in sub.inputs if k in self.values and tasks[k].node is None]
        if unplaced:
            refs = [self.values[k] for k in unplaced]
            try:
                where = ray.experimental.get_object_locations(refs, timeout_ms=2000)
            except Exception:  # the owner cannot say: assume the worst
                where = {}
            # Ray stores the error of an object it cannot recover on its owner's node,
            # and lists that node as the object's location: a copy there proves nothing.
            here = ray.get_runtime_context().get_node_id()
            alive = {n for n in self.alive if n != here and self.state.is_alive(n)}
            for k, ref in zip(unplaced, refs, strict=True):
                if k not in gone and not alive.intersection(
                    (where.get(ref) or {}).get("node_ids", ())
                ):
                    gone.append(k)
        return tuple(gone)

    def _hex(self, key: Key) -> str | None:
        ref = self.values.get(key)
        return ref.hex() if ref is not None else None

    def _ref(self, key: Key) -> ray.ObjectRef:
        ref = self.values.get(key)
        return given_ref(self.graph.external[key]) if ref is None else ref

    # ---- instructions out ------------------------------------------------------------

    def _carry_out(self, instructions: list[Instruction]) -> None:
        cancelled: list[ray.ObjectRef] = []
        for ins in instructions:
            cls = type(ins)
            if cls is Submit:
                self._submit(ins)
            elif cls is Release:
                self.values.pop(ins.key, None)
                if self.dask_state is not None:
                    self.dask_state["released"].add(ins.key)
            elif cls is Cancel:
                meta_ref = self.by_copy.pop(ins.copy, None)
                if meta_ref is not None:
                    _, value_refs = self.pending.pop(meta_ref)
                    cancelled.append(value_refs[0])
                    graveyard.hold(meta_ref, value_refs)
                    if self.force_cancel and ins.node is not None:
                        self._spare(ins.node)
            elif cls is Fail:
                self.failure = ins
            elif cls is Won:
                logger.info(
                    "raydag: a duplicate of %r won (%s); about %.1f s saved",
                    ins.key,
                    ins.reason,
                    ins.saved,
                )
            elif cls is Checkpoint:
                node = self.state.tasks[ins.key].node  # where the value lives
                self._watch(self.checkpoints.write(ins.key, self.values[ins.key], node))  # type: ignore[union-attr]
            elif cls is DropCheckpoints:
                self.checkpoints.drop(ins.keys)  # type: ignore[union-attr]
            elif cls is RemoveCheckpoints:
                self.checkpoints.discard(ins.keys)  # type: ignore[union-attr]
            elif cls is CheckpointsOff:
                logger.warning("raydag: checkpoints off: %s", ins.reason)
            elif cls is CheckpointIgnored:
                logger.warning(
                    "raydag: ignoring the checkpoint of %r (%s); computing it", ins.key, ins.reason
                )
            elif cls is NodeTakenDead:
                logger.warning("raydag: taking node %s for dead: %s", ins.node[:12], ins.reason)
            elif cls is Recover:
                for k in ins.recompute:
                    self.values.pop(k, None)
                logger.warning(
                    "raydag: recovery wave %d: %d lost results, %d tasks to recompute (%s)",
                    ins.wave,
                    len(ins.lost),
                    len(ins.recompute),
                    ins.reason,
                )
                if logger.isEnabledFor(logging.DEBUG):  # a wave may lose thousands
                    logger.debug("raydag: wave %d lost %s", ins.wave, _few(ins.lost))
                    kept = self.state.recoverer.kept
                    if kept:
                        logger.debug("raydag: kept, read by running tasks: %s", _few(kept))
        cancel(cancelled, self.force_cancel)
        if self._unsubmitted is not None and not self._unsubmitted:
            self._all_submitted()

    def _all_submitted(self) -> None:
        """``_ray_postsubmit_all``, once: every task the outputs need is submitted."""
        if not self._awaiting_all or self._unsubmitted is None or self._unsubmitted:
            return
        self._awaiting_all = False
        self._unsubmitted = None
        refs = {k: self._output_refs.get(k, self.values.get(k)) for k in self.graph.outputs}
        refs = {k: self._ref(k) if r is None else r for k, r in refs.items()}
        self._output_refs.clear()
        self.hooks.submitted_all(refs, self.graph.tasks)  # type: ignore[union-attr]

    def _spare(self, node: str) -> None:
        """A forced cancel kills the copy's worker process, and Ray starts another only
        when a task needs it: a node whose loser was cancelled would make its next task
        (the graph's last, perhaps) wait 0.4-3 s for a process. A task needing no CPU
        starts one now, while the node is idle, and leaves it idle in the pool."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        there = NodeAffinitySchedulingStrategy(node, soft=True)
        spare_worker.options(scheduling_strategy=there).remote()

    def _submit(self, sub: Submit) -> None:
        spec: Any = tuple(sorted(sub.resources.items())) if sub.resources else None
        if sub.returns:  # several values kept: one Ray object each, and the Outcome
            spec = (spec, len(sub.returns))
        # remote_args: one object per distinct dict for the compute (core.options)
        args = id(sub.remote_args) if sub.remote_args else None
        cached = (spec, sub.node, sub.soft, sub.spill, args)
        fn = self._options.get(cached)
        if fn is None:
            opts = ray_options(sub.resources)
            if sub.returns:
                opts["num_returns"] = len(sub.returns) + 1
            if self.ray_retries:
                opts["max_retries"] = self.ray_retries
            if sub.node is not None:
                # A duplicate: on that node and no other (soft=False), never by its
                # original. A placed task: there if it can, elsewhere if that node is
                # gone, or has no CPU free and ``spill`` (soft).
                opts["scheduling_strategy"] = node_affinity(sub.node, sub.soft, sub.spill)
            opts.update(sub.remote_args or {})  # the user's ray_remote_args, as given
            fn = self._options[cached] = remote_group.options(**opts)
        notify = None
        if sub.notify:
            if self._inbox is None:
                self._inbox = inbox()
            notify = (self._inbox, self.run_id, sub.copy, sub.notify_after)
            self._notes_after = max(self._notes_after, sub.notify_after)
        nodes = [self.graph.tasks[k] for k in sub.keys]
        if sub.restore:  # read back from their checkpoints, not computed
            nodes = [
                self.checkpoints.read_back(n.key) if n.key in sub.restore else n for n in nodes
            ]  # type: ignore[union-attr]
        refs = [self._ref(k) for k in sub.inputs]
        hooks = self.hooks
        shortcut = None
        if hooks is not None and hooks.presubmit and not sub.duplicate:
            shortcut = self._presubmit(sub, refs)
        if shortcut is not None:
            *value_refs, meta_ref = shortcut
        else:
            kw: dict[str, Any] = {"returns": sub.returns} if sub.returns else {}
            if hooks is not None and hooks.worker:
                kw["hooks"] = hooks.worker
            if handed_out[0]:  # the nodes may hold ObjectRefs: Ray's own pickling, whole
                kw["resolve"] = True
                payload, shared = nodes, ()
            else:
                payload, shared = self._shipper.pack(nodes)
            if shared:
                kw["shared"] = shared
            *value_refs, meta_ref = fn.remote(payload, sub.inputs, notify, *refs, **kw)
            if hooks is not None and hooks.postsubmit:
                self._postsubmit(sub, refs, value_refs)
        if self._awaiting_all:  # postsubmit_all to come: the outputs' refs
            if self._unsubmitted is not None:
                self._unsubmitted.difference_update(sub.keys)
            outputs = self.graph.outputs
            self._output_refs.update(
                (k, r) for k, r in zip(sub.kept, value_refs, strict=True) if k in outputs
            )
        self.pending[meta_ref] = (sub, tuple(value_refs))
        self.by_copy[sub.copy] = meta_ref
        self._watch(meta_ref)
        if self.dask_state is not None and not sub.duplicate:
            s = self.dask_state
            for k in sub.keys:
                s["waiting"].discard(k)
                s["running"].add(k)
                for f in self.pretask:
                    f(k, self.graph.tasks, s)

    def _hook_deps(self, sub: Submit, key: Key, refs: list, kept: dict, last: Any) -> dict:
        """A dask task's dependencies as Ray's hooks see them: each one's ObjectRef; one
        computed in the same Ray task (fused), that Ray task's."""
        given = dict(zip(sub.inputs, refs, strict=True))
        return {d: given.get(d, kept.get(d, last)) for d in self.graph.tasks[key].dependencies}

    def _presubmit(self, sub: Submit, refs: list) -> tuple | None:
        """``_ray_presubmit``: a value in place of the task, carried out as a copy that
        has finished (its value put in the object store, its outcome known). The
        compute has no fusion nor bundles (``raydag.runtime.run``): one key a copy."""
        (key,) = sub.keys
        task = self.graph.tasks[key]
        if isinstance(task, DataNode):
            return None
        value = self.hooks.presubmitted(task, key, self._hook_deps(sub, key, refs, {}, None))  # type: ignore[union-attr]
        if value is None:
            return None
        outcome = Outcome(
            [0.0],
            sizeof(value),
            ray.get_runtime_context().get_node_id(),
            os.getpid(),
            time.time(),
        )
        return ray.put(value), ray.put(outcome)

    def _postsubmit(self, sub: Submit, refs: list, value_refs: list) -> None:
        """``_ray_postsubmit`` per dask task of the Ray task, with the ref it returns for
        it (the group's last, for a member whose value never leaves the task)."""
        kept = dict(zip(sub.kept, value_refs, strict=True))
        last = value_refs[-1]
        for k in sub.keys:
            task = self.graph.tasks[k]
            if not isinstance(task, DataNode):
                deps = self._hook_deps(sub, k, refs, kept, last)
                self.hooks.submitted(task, k, deps, kept.get(k, last))  # type: ignore[union-attr]

    def _posttask(self, sub: Submit, outcome: Outcome) -> None:
        s = self.dask_state
        for k in sub.keys:
            s["running"].discard(k)
            s["finished"].add(k)
            for f in self.posttask:
                f(k, None, self.graph.tasks, s, outcome.pid)


def _with(sub: Submit) -> str:
    """The other tasks of a retried group: they run again too (their values never left)."""
    others = [k for k in sub.keys if k != sub.root]
    return f" (with {', '.join(map(repr, others))} in its Ray task)" if others else ""


def _outcome(
    meta_ref: ray.ObjectRef, value_refs: Sequence[ray.ObjectRef], read: tuple | None = None
) -> Outcome | Exception:
    """A Ray task's outcome, or Ray's error for it (see ``frameless``): as ``read``
    (``(value, error)`` from Ray's callback, the same as ``ray.get`` gives), else
    by ``ray.get``.
    When the task failed, its value refs hold the error too: read them, or Ray logs each
    as an "Unhandled error" when it is dropped (a line per value per worker death, on
    top of raydag's own warning)."""
    try:
        if read is None:
            return ray.get(meta_ref)
        if read[1] is None:
            return read[0]
        raise read[1]
    except Exception as e:
        for ref in value_refs:
            try:
                ray.get(ref, timeout=0)
            except Exception as again:
                frameless(again)
        return frameless(e)


def frameless(e: BaseException) -> BaseException:
    """``e`` without its traceback, nor those of the errors it chains to.

    ``ray.get`` raises an error it holds in a local variable: the error and that frame
    refer to each other, a cycle only the garbage collector frees. The frames hold the
    refs they were given, and so the objects stay in the store until a collection runs,
    or for as long as a caller keeps the error (a notebook keeps the last one). They
    are Ray's and raydag's frames on the driver, which tell a user nothing.
    """
    todo, seen = [e], set()
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        x.__traceback__ = None
        todo += [x.__context__, x.__cause__]
    return e


def _few(keys: Iterable, n: int = 40) -> str:
    """Keys for a debug line: the first ``n`` of them, sorted, and how many more."""
    shown = sorted(map(repr, keys))
    more = f" and {len(shown) - n} more" if len(shown) > n else ""
    return ", ".join(shown[:n]) + more


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
