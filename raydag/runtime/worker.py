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

import io
import os
import pickle
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

from raydag.compat import DataNode, Task


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
    nodes: list,
    input_keys: tuple,
    notify: Any,
    *inputs: Any,
    returns: tuple = (),
    hooks: tuple = (),
    resolve: bool = False,
) -> tuple[Any, ...]:
    """Run fused dask tasks in order; return the kept values, then an Outcome.

    ``returns``: the keys whose values to keep, each its own Ray object (a shuffle's
    pieces: the Ray task has ``len(returns) + 1`` returns); empty: the last key's.
    ``notify``: ``(inbox, run, tag)`` to say where and when it started (see ``_Inbox``).
    ``hooks``: ``(pretask, posttask)`` pairs of Ray's ``RayDaskCallback``s, called
    around each dask task (``raydag.runtime.ray_hooks``); an error in one is the task's.
    ``resolve``: the tasks may hold ObjectRefs that dask inlined as data (the values of a
    ``ray_persist=True`` result, fused into a task): read them first, as Ray's would.
    """
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
    if notify is not None:
        inbox, run, tag = notify
        inbox.started.remote(run, tag, ray.get_runtime_context().get_node_id(), started)
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
    ctx = ray.get_runtime_context()
    return values, Outcome(durations, 0, ctx.get_node_id(), os.getpid(), started)


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
