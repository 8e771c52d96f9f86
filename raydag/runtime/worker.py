"""What runs inside a Ray task: a group's dask tasks in order, and errors packed whole.

The driver sends ``run_group`` the group's task nodes and its inputs' refs; the task
returns each kept value as its own Ray object, then an ``Outcome``: runtimes, sizes,
where and when it ran, or the user's error with its traceback (``tblib``), so that the
driver raises it with its own type.

Whatever a task raises is the user's error, ``KeyboardInterrupt`` and ``SystemExit``
included (dask's own schedulers raise those from a task as they are): shipped back,
not left to end the worker process, which Ray would take for a crash. The one
exception is Ray's own cancel: without ``force``, Ray interrupts the task's thread
with a ``KeyboardInterrupt``, which is passed on to Ray (a ``TaskCancelledError``).
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import queue
import threading
import time
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
import ray.cloudpickle
from dask.sizeof import sizeof

from raydag.compat import DataNode, Task, TaskRef

logger = logging.getLogger("raydag.runtime")


@dataclass
class Outcome:
    """What a group's Ray task tells the driver, apart from the value itself."""

    durations: list[float]
    nbytes: int = 0
    node: str = ""
    pid: int = 0
    started: float = 0.0
    error: bytes | None = None
    error_key: Any = None
    sizes: list[int] | None = None  # of each kept value, when a group keeps several
    warnings: bytes | None = None  # what its tasks warned, for the driver to warn again


def run_group(
    nodes: Any,
    input_keys: tuple,
    notify: Any,
    *inputs: Any,
    returns: tuple = (),
    hooks: tuple = (),
    resolve: bool = False,
    shared: tuple = (),
) -> tuple[Any, ...]:
    """Run fused dask tasks in order; return the kept values, then an Outcome.

    ``returns``: the keys whose values to keep, each its own Ray object (a shuffle's
    pieces: the Ray task has ``len(returns) + 1`` returns); empty: the last key's.
    ``notify``: ``(inbox, run, tag, after)`` to say where and when it started, once it
    has run ``after`` seconds (see ``Inbox``, ``_StartNotes``).
    ``hooks``: ``(pretask, posttask)`` pairs of Ray's ``RayDaskCallback``s, called
    around each dask task (``raydag.runtime.ray_hooks``); an error in one is the task's.
    ``resolve``: the tasks may hold ObjectRefs that dask inlined as data (the values of a
    ``ray_persist=True`` result, fused into a task): read them first, as Ray's would.
    ``shared``: refs of the callables the nodes share with other tasks of the compute,
    when ``nodes`` comes packed by a ``Shipper`` (a node's ``Shared`` names one).
    """
    if shared:
        nodes = _unpack(nodes, shared)
    if resolve:
        nodes = [resolve_inlined_refs(node) for node in nodes]
    values, outcome = _run_nodes(nodes, input_keys, notify, inputs, hooks)
    kept = returns or (nodes[-1].key,)
    if outcome.error is not None:
        return (*[None] * len(kept), outcome)
    results = [_shippable(values[k]) for k in kept]
    outcome.sizes = [sizeof(r) for r in results]
    outcome.nbytes = sum(outcome.sizes)
    return (*results, outcome)


def _shippable(value: Any) -> Any:
    """A generator (a bag's partition may be one) cannot be pickled into Ray's store:
    it is run to its end here and passed on as an iterator over what it made, which its
    readers iterate as they would the generator (dask.bag itself ``reify``s them)."""
    return iter(list(value)) if isinstance(value, types.GeneratorType) else value


def _run_nodes(
    nodes: list, input_keys: tuple, notify: Any, inputs: tuple, hooks: tuple = ()
) -> tuple[dict, Outcome]:
    """Every warning the tasks raise is caught ("always": the worker's once-per-place
    registry must not hide a warning from the driver) and shipped; the driver warns
    again under its own filters, as when dask's threads ran the task."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, outcome = _run_caught(nodes, input_keys, notify, inputs, hooks)
    if caught:
        outcome.warnings = pack_warnings(caught)
    return values, outcome


def _run_caught(
    nodes: list, input_keys: tuple, notify: Any, inputs: tuple, hooks: tuple
) -> tuple[dict, Outcome]:
    started = time.time()
    ended = None
    if notify is not None:
        inbox, run, tag, after = notify
        note = (run, tag, _node_id(), started)
        if after > 0:
            ended = _start_notes().send(after, inbox, note)
        else:  # at once, before the task may hold the interpreter for its whole run
            inbox.started.remote(*note)
    try:
        return _run_from(nodes, input_keys, inputs, hooks, started)
    finally:
        if ended is not None:
            ended.set()


def _run_from(
    nodes: list, input_keys: tuple, inputs: tuple, hooks: tuple, started: float
) -> tuple[dict, Outcome]:
    values = dict(zip(input_keys, inputs, strict=True))
    durations = []
    node = None
    try:
        for node in nodes:
            if hooks and not isinstance(node, DataNode):
                args = tuple(values[d] for d in node.dependencies)
                states = [pre(node.key, args) if pre else None for pre, _ in hooks]
            t0 = time.perf_counter()
            values[node.key] = node(values)
            durations.append(time.perf_counter() - t0)
            if hooks and not isinstance(node, DataNode):
                for (_, post), pre_state in zip(hooks, states, strict=True):
                    if post is not None:
                        post(node.key, values[node.key], pre_state)
    except BaseException as e:  # a user's error: ship it back whole, do not let Ray retry
        if isinstance(e, KeyboardInterrupt) and _cancelled_by_ray():
            raise  # Ray's cancel, not the task's: Ray makes it a TaskCancelledError
        key = node.key if node is not None else None
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: from where?
            _note(e, f"raised by the task {key!r} (in a Ray worker)")
        return values, Outcome(durations, error=pack_exception(e), error_key=key)
    return values, Outcome(durations, 0, _node_id(), os.getpid(), started)


class _StartNotes:
    """A worker process's start notes, sent by a thread of their own.

    ``send(after, ...)`` sends the note once the task has run ``after`` seconds, if it
    still runs (``Submit.notify_after``); setting the returned event says it ended. The
    worker runs one task at a time, so the thread waits on one note at a time. (A task
    that holds the interpreter in one long call of C code delays its note: the wait is
    for tasks not measured yet, whose first runs show which categories are long.)
    """

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._sending, name="raydag-start-notes", daemon=True).start()

    def send(self, after: float, inbox: Any, note: tuple) -> threading.Event:
        ended = threading.Event()
        self.queue.put((time.monotonic() + after, ended, inbox, note))
        return ended

    def _sending(self) -> None:
        while True:
            due, ended, inbox, note = self.queue.get()
            if not ended.wait(due - time.monotonic()):
                try:
                    inbox.started.remote(*note)
                except Exception as e:  # the next notes still go
                    logger.warning("raydag: could not send a start note: %r", e)


@functools.cache
def _start_notes() -> _StartNotes:
    """This worker process's, made by its first note."""
    return _StartNotes()


@functools.cache
def _node_id() -> str:
    """This worker process's node: it never changes."""
    return ray.get_runtime_context().get_node_id()


def resolve_inlined_refs(x: Any) -> Any:
    """``x`` with every ``DataNode`` holding a ``ray.ObjectRef`` (within task arguments,
    subgraphs, containers) holding its value instead. Raw ObjectRef arguments are the
    user's and stay as they are, as under dask's own schedulers."""
    if isinstance(x, DataNode):
        return DataNode(x.key, ray.get(x.value)) if isinstance(x.value, ray.ObjectRef) else x
    if isinstance(x, Task):
        x.args = tuple(resolve_inlined_refs(a) for a in x.args)
        if x.kwargs:
            x.kwargs = {k: resolve_inlined_refs(v) for k, v in x.kwargs.items()}
        return x
    if type(x) is dict:
        return {k: resolve_inlined_refs(v) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(resolve_inlined_refs(v) for v in x)
    return x


# A task's callable whose pickle is longer than this is shipped once per compute: one
# pickled by value (a closure, a class of ``__main__``, most of what dask-awkward and
# coffea make) is about a kilobyte and 0.1 ms to pickle; one pickled by reference
# (an importable function) is its module and name, some tens of bytes.
SHARED_PICKLE_BYTES = 256


class Shipper:
    """The group payloads of one compute, with each shared callable shipped once.

    Ray pickles a task's arguments afresh for every task, and a callable cloudpickle
    cannot import it pickles by value, code and all: the same one again for every
    partition. Here each task callable (``Task.func``) whose pickle is longer than
    ``SHARED_PICKLE_BYTES`` is ``ray.put`` once, when a second group has it (a compute
    of one task puts nothing: a put costs the driver about 2 ms). A group whose nodes
    call one is pickled here (``_ShippingPickler``), each such callable named by its
    position in the group's list of refs, which goes with the Ray task; a worker
    process reads each ref once, keeps it, and unpickles the nodes with it
    (``_unpack``). Groups without one go as they are, pickled by Ray.

    For 200 partitions of a skim whose tasks share one processor defined in a notebook,
    the processor is pickled and put once, not 200 times; each payload holds its
    position (a small int) and each Ray task its ref::

        payload, shared = shipper.pack(nodes)   # shared: () or refs for run_group
        remote_group.remote(payload, input_keys, notify, *inputs, shared=shared)
    """

    def __init__(self) -> None:
        # id(callable) -> its ref, or None if it is cheap to pickle; the callables are
        # held, so that no other object takes one's id while the compute runs
        self._refs: dict[int, Any] = {}
        self._held: list[Any] = []

    def pack(self, nodes: list) -> tuple[Any, tuple]:
        """``(payload, shared refs)`` for ``run_group``: ``nodes`` and ``()``, or a packed
        payload and the refs it names."""
        index: dict[int, int] = {}
        refs: list[ray.ObjectRef] = []
        for node in nodes:
            func = getattr(node, "func", None)
            if func is None:
                continue
            key = id(func)
            ref = self._refs.get(key, _FIRST)
            if ref is _FIRST:  # seen once: goes as it is (a one-task compute puts nothing)
                self._refs[key] = _ONCE
                self._held.append(func)
                continue
            if ref is _ONCE:
                ref = self._refs[key] = self._ship(func)
            if ref is not None and key not in index:
                index[key] = len(refs)
                refs.append(ref)
        if not refs:
            return nodes, ()
        buf = io.BytesIO()
        _ShippingPickler(buf, index).dump(nodes)
        return buf.getvalue(), tuple(refs)

    def _ship(self, func: Any) -> ray.ObjectRef | None:
        """The callable's pickle, put as bytes: a worker keeps what it unpickles from
        them, not Ray's zero-copy view of the object (arrays in a callable would pin
        the put object in the store for as long as the worker keeps it)."""
        try:
            blob = ray.cloudpickle.dumps(func)
        except Exception:  # Ray's own pickling will say what is wrong, as before
            return None
        return None if len(blob) <= SHARED_PICKLE_BYTES else ray.put(blob)


_FIRST = object()  # a callable not seen yet in this compute
_ONCE = object()  # seen in one group: shipped with it, as any other


def _shared(at: int) -> Any:
    """In a shipped payload, in place of a shared callable: the Ray task's ``at``-th
    (``_unpack`` says which callables this payload's are, while it unpickles it)."""
    return _reading.callables[at]


_reading = threading.local()


def _task(key: Any, func: Any, args: tuple, kwargs: dict, data_producer: bool) -> Any:
    return Task(key, func, *args, _data_producer=data_producer, **kwargs)


class _ShippingPickler(ray.cloudpickle.CloudPickler):
    """Ray's cloudpickle, with the shared callables named by position and a plain
    ``Task`` or ``TaskRef`` reduced in one Python call (cloudpickle's reducer, a
    dispatch look-up in a ``ChainMap`` and dask's ``__getstate__`` were four, 9 us of
    the 10 a task cost; a ``persistent_id`` is a Python call per object pickled, ints
    and strings included). Anything else goes the way Ray would pickle it."""

    def __init__(self, file: io.BytesIO, index: dict[int, int]) -> None:
        super().__init__(file, protocol=ray.cloudpickle.DEFAULT_PROTOCOL)
        self._index = index

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is Task:
            return _task, (obj.key, obj.func, obj.args, obj.kwargs, obj.data_producer)
        if cls is TaskRef:
            return TaskRef, (obj.key,)
        at = self._index.get(id(obj))
        if at is not None:
            return _shared, (at,)
        return super().reducer_override(obj)


_shared_read: dict[str, Any] = {}  # this worker process's shared callables, by ref
_SHARED_KEPT = 64


def _unpack(blob: bytes, shared: tuple) -> list:
    callables = []
    for ref in shared:
        key = ref.hex()
        if key not in _shared_read:
            if len(_shared_read) >= _SHARED_KEPT:  # of ended computes, most likely
                del _shared_read[next(iter(_shared_read))]
            _shared_read[key] = ray.cloudpickle.loads(ray.get(ref))
        callables.append(_shared_read[key])
    _reading.callables = callables
    try:
        return pickle.loads(blob)
    finally:
        _reading.callables = None


def _cancelled_by_ray() -> bool:
    """Has Ray cancelled this task? Ray's cancel without ``force`` raises
    ``KeyboardInterrupt`` in the task's thread, as a task of its own may."""
    try:
        return bool(ray.get_runtime_context().is_canceled())
    except Exception:  # a Ray without it: ship it; the driver reads no cancelled outcome
        return False


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(text)


def _nothing() -> None:
    return None


spare_worker = ray.remote(num_cpus=0, max_retries=0)(_nothing)


def _import(modules: list[str]) -> list[str]:
    """Import ``modules`` here (this module too, by running): a warm worker process.
    Returns those imported; one failing here fails again, and says why, in the task
    that needs it."""
    import importlib

    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:
            continue
        done.append(name)
    return done


warm_worker = ray.remote(num_cpus=1, max_retries=0)(_import)


# raydag retries and recovers tasks itself, from its own lineage (docs/recovery.md):
# Ray's retries would re-run lost work one object at a time, behind raydag's back.
remote_group = ray.remote(num_returns=2, max_retries=0)(run_group)


def pack_exception(e: BaseException) -> bytes:
    """``e`` and its traceback, pickled for the driver.

    With Ray's cloudpickle, as Ray ships the task's functions: a class defined in
    ``__main__`` (a script's, a notebook's) goes by value, and the driver's cloudpickle
    gives back the driver's own class, so ``except MainError:`` catches it there. An
    error that cannot be pickled even so, or not rebuilt, becomes a ``RuntimeError``
    naming its type and message.
    """
    from tblib import Traceback

    tb = e.__traceback__.tb_next if e.__traceback__ else None  # drop run_group's frame
    try:
        blob = _dumps((e, Traceback(tb).as_dict() if tb else None))
        pickle.loads(blob)  # some pickle but cannot be rebuilt (e.g. required __init__ args)
        return blob
    except Exception:
        plain = RuntimeError(f"{type(e).__name__}: {e} (the exception could not be pickled)")
        return pickle.dumps((plain, Traceback(tb).as_dict() if tb else None))


def pack_warnings(caught: list[warnings.WarningMessage]) -> bytes:
    """The warnings as ``(category, text, filename, lineno)``, pickled for the driver;
    a category that cannot be pickled becomes a ``UserWarning`` naming it."""
    found = [(w.category, str(w.message), w.filename, w.lineno) for w in caught]
    try:
        return _dumps(found)
    except Exception:
        return pickle.dumps([(UserWarning, f"{c.__name__}: {t}", f, n) for c, t, f, n in found])


def warn_again(blob: bytes) -> None:
    """On the driver: the task's warnings, warned where the task raised them."""
    for category, text, filename, lineno in pickle.loads(blob):
        warnings.warn_explicit(text, category, filename, lineno)


class _ErrorPickler(ray.cloudpickle.CloudPickler):
    """Ray's cloudpickle, but builtin exceptions with an ``__init__`` of their own
    (``SystemExit``, ``StopIteration``, ``UnicodeDecodeError``, ...) pickled their own
    way: dask.multiprocessing installs ``tblib.pickling_support`` in ``copyreg`` on
    import, whose reducer rebuilds them without calling it (``SystemExit(3).code``
    comes back ``None``)."""

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if (
            isinstance(obj, BaseException)
            and cls.__module__ == "builtins"
            and cls.__init__ not in (BaseException.__init__, OSError.__init__)
        ):
            return obj.__reduce__()
        return super().reducer_override(obj)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _ErrorPickler(buf, protocol=ray.cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buf.getvalue()


def unpack_exception(blob: bytes) -> BaseException:
    exc, tb = pickle.loads(blob)
    if tb is not None:
        exc = exc.with_traceback(_rebuilt(tb))
    return exc


def _rebuilt(tb: dict) -> Any:
    """tblib makes each frame of the traceback by running code, and a frame keeps its
    caller's frame (``f_back``) and so its locals: made on the driver loop's stack, the
    error would keep the loop's refs, and their objects, for as long as it lives. A
    fresh thread's stack holds none."""
    from tblib import Traceback

    made: list = []
    t = threading.Thread(target=lambda: made.append(Traceback.from_dict(tb).as_traceback()))
    t.start()
    t.join()
    return made[0]


def ray_options(resources: Mapping[str, float] | None) -> dict:
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
