"""A coffea ``processor.Runner`` executor that runs chunks and their reduction on Ray.

``processor.Runner(executor=RayExecutor(), ...)``. Each work item (a file's metadata
when preprocessing, a chunk of events when processing) is one Ray task; outputs are
merged in Ray tasks of ``treereduction`` partial results each as they finish, so only
the final accumulator is read by the driver. This module is the only one that imports
coffea: ``import raydag`` works without it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import ray
import ray.exceptions as rex
from coffea.processor.accumulator import accumulate
from coffea.processor.executor import ExecutorBase
from coffea.util import rich_bar

from raydag import config, runtime
from raydag.compat import coffea_helpers

_compression_wrapper, _decompress, _reduce = coffea_helpers()

logger = logging.getLogger(__name__)


def _process(function: Callable, item: Any) -> tuple[Any, bytes | None]:
    """One work item, and its error if it raised: the driver reads that, not the output.

    A user's exception comes back as a value, not as a Ray task error: Ray would hold
    a reference cycle through its frames, pinning the run's objects until ``gc``.
    """
    try:
        return function(item), None
    except Exception as e:
        return None, runtime.pack_exception(e)


def _merge(reducer: Callable, *parts: Any) -> tuple[Any, bytes | None]:
    """Merge partial outputs (Ray resolved them on this worker), compressed as they came.

    A work item skipped as a bad file (``skipbadfiles``) made ``None``; merged with
    nothing else, it stays ``None``, as coffea's other executors accumulate it (coffea's
    reducer raises "Empty list provided to reduction" on a batch of them alone).
    """
    parts = tuple(p for p in parts if p is not None)
    if not parts:
        return None, None
    return _process(reducer, parts)


_process_remote = ray.remote(num_returns=2)(_process)
_merge_remote = ray.remote(num_returns=2)(_merge)


@dataclass
class RayExecutor(ExecutorBase):
    """Execute on Ray: the initialised cluster, ``RAY_ADDRESS``, or an embedded one.

    Parameters (besides coffea's ``status``, ``unit``, ``desc``, ``compression``)
    -----------------------------------------------------------------------------
    treereduction : int
        Partial outputs merged per Ray task (default 20). Merging starts as soon as that
        many are done, so the object store holds few partial results at a time.
    retries : int
        Read by ``Runner``: how many times a failing work item is retried in its task.
    recoverable : bool
        On a failure, stop submitting, merge what finished and return
        ``(partial accumulator, exception)`` instead of raising.
    in_flight_per_cpu : float
        Work items in flight per cluster CPU; the rest wait on the driver, so merges
        are not queued behind every chunk.
    remote_options : dict, optional
        Ray options for each work item's task, e.g. ``{"num_cpus": 1, "memory": 2**31}``.

    Tasks whose worker process or node died are retried by Ray up to ``raydag.retries``
    times, and lost partial results are rebuilt from their lineage.
    """

    treereduction: int = 20
    retries: int = 3
    recoverable: bool = False
    in_flight_per_cpu: float = 2.0
    remote_options: dict[str, Any] | None = None

    def __call__(
        self, items: Iterable, function: Callable, accumulator: Any
    ) -> tuple[Any, int | BaseException]:
        items = list(items)
        if not items:
            return accumulator, 0
        if self.treereduction < 2:
            raise ValueError(f"treereduction must be at least 2, got {self.treereduction}")
        runtime.connect()
        if self.compression is not None:
            function = _compression_wrapper(self.compression, function, name=self.function_name)
        run = _Run(self, items, function)
        try:
            progress = rich_bar()  # coffea's bars, as its other executors draw them
            progress.disable = not self.status
            with progress:
                run.progress = progress
                run.bar = progress.add_task(self.desc, total=len(items), unit=self.unit)
                run.merge_bar = progress.add_task(
                    "Merging (on the cluster)", total=0, unit="merges"
                )
                run.loop()
            out = None if run.fatal or not run.ready else _decompress(ray.get(run.ready[0]))
        finally:  # a failure with recoverable=False, or Ctrl-C: stop everything
            run.cancel_all()
        error, item, fatal = run.error, run.error_item, run.fatal
        del run
        if error is not None:
            # rebuilt here, not in the loop: the traceback's frames would pin its refs
            if isinstance(error, bytes):
                error = runtime.unpack_exception(error)
                _note(error, f"raised in a Ray task for {item}")
            else:
                _note(error, f"while running {item}")
            if fatal:
                raise error
            logger.warning("returning partial results after %r", error)
        return accumulate([out, accumulator]), error if error is not None else 0


class _Run:
    """One executor call: what is queued, running, finished and not merged yet."""

    def __init__(self, executor: RayExecutor, items: list, function: Callable):
        self.ex = executor
        self.pending = deque(items)
        self.total = len(items)
        self.function = ray.put(function)  # shipped once, not with every task
        self.reducer = ray.put(_reduce(executor.compression))
        retries = int(config.get("retries"))
        opts = {"max_retries": retries, "retry_exceptions": False}
        self.process = _process_remote.options(**opts, **(executor.remote_options or {}))
        self.merge = _merge_remote.options(**opts)
        self.running: dict[ray.ObjectRef, tuple[ray.ObjectRef, Any]] = {}  # status: (out, item)
        self.merging: dict[ray.ObjectRef, ray.ObjectRef] = {}  # status: out
        self.ready: list[ray.ObjectRef] = []  # outputs done and not merged yet
        self.done = self.merges = self.merges_done = 0
        self.error: bytes | BaseException | None = None  # the first failure's
        self.error_item: Any = None
        self.fatal = False  # the first failure without recoverable, or a merge's
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.limit = max(1, round(cpus * executor.in_flight_per_cpu))
        self.progress: Any = None
        self.bar = self.merge_bar = None

    def loop(self) -> None:
        t0 = time.perf_counter()
        while not self.fatal:
            self.submit()
            if not self.running and not self.merging:
                break
            self.collect()
        logger.info(
            "%d of %d items done in %.2f s; %d merges on the cluster",
            self.done,
            self.total,
            time.perf_counter() - t0,
            self.merges,
        )

    def submit(self) -> None:
        while self.pending and self.error is None and len(self.running) < self.limit:
            item = self.pending.popleft()
            out, status = self.process.remote(self.function, item)
            self.running[status] = (out, item)
        n = self.ex.treereduction
        more_coming = bool(self.running) or (bool(self.pending) and self.error is None)
        while len(self.ready) >= n or (not more_coming and len(self.ready) > 1):
            batch, self.ready = self.ready[:n], self.ready[n:]
            out, status = self.merge.remote(self.reducer, *batch)
            self.merging[status] = out
            self.merges += 1
            self.progress.update(self.merge_bar, total=self.merges)

    def collect(self) -> None:
        waiting = [*self.running, *self.merging]
        done, waiting = ray.wait(waiting, num_returns=1, timeout=1.0, fetch_local=False)
        if waiting:  # whatever else is done by now, without waiting longer
            more, _ = ray.wait(waiting, num_returns=len(waiting), timeout=0, fetch_local=False)
            done += more
        for status in done:
            if status in self.running:
                out, item = self.running.pop(status)
                if self._ok(status, out, item):
                    self.ready.append(out)
                    self.done += 1
            else:
                out = self.merging.pop(status)
                if not self._ok(status, out, "(output reducer)"):
                    self.fatal = True  # its inputs are gone with it
                    return
                self.ready.append(out)
                self.merges_done += 1
            if self.fatal:
                return
        self.progress.update(self.bar, completed=self.done)
        self.progress.update(self.merge_bar, completed=self.merges_done, refresh=True)

    def _ok(self, status: ray.ObjectRef, out: ray.ObjectRef, item: Any) -> bool:
        """Whether the task made its output; its status is tiny, the output stays put."""
        try:
            error = ray.get(status)  # None, or the user's exception, pickled
            if error is None:
                return True
        except rex.RayError as e:  # the worker or node died more than Ray retries, cancelled
            try:  # read, so Ray does not log it as unhandled
                ray.get(out, timeout=0)
            except Exception as again:
                runtime.frameless(again)
            error = runtime.frameless(e)  # Ray's frames would hold this run's refs
        if self.error is not None:  # cancelled or failed after the first failure
            logger.debug("after the first failure: %s", item)
            return False
        self.error, self.error_item = error, item
        if not self.ex.recoverable:
            self.fatal = True
            return False
        logger.warning("%s failed: merging what finished", item)
        self.pending.clear()
        runtime.cancel(list(self.running), force=False)
        return False

    def cancel_all(self) -> None:
        runtime.cancel([*self.running, *self.merging], force=bool(config.get("cancel.force")))
        outs = {**{s: out for s, (out, _) in self.running.items()}, **self.merging}
        for status, out in outs.items():  # see runtime._Graveyard
            runtime.hold_until_ended(status, (out,))
        self.function = self.reducer = None
        self.running.clear()
        self.merging.clear()
        self.ready.clear()


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(text)
