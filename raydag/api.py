"""What users call: a dask scheduler ``get``, a ``persist`` that keeps results in Ray, and
``enable``/``disable``, which make raydag dask's scheduler and its shuffle dask's shuffle."""

from __future__ import annotations

import logging
import pickle
import threading
import warnings
from collections.abc import Sequence
from contextlib import nullcontext
from types import TracebackType
from typing import Any

import dask
from dask.utils import Dispatch

from raydag import runtime
from raydag.core.graph import UnknownAnnotationWarning
from raydag.runtime import ray_hooks
from raydag.runtime.persisted import handed_out

__all__ = [
    "Enabled",
    "IgnoredArgumentsWarning",
    "UnknownAnnotationWarning",
    "disable",
    "disable_dask_on_ray",
    "enable",
    "enable_dask_on_ray",
    "get",
    "persist",
    "ray_dask_get",
    "ray_dask_get_sync",
    "ray_dask_persist",
    "ray_get",
]

logger = logging.getLogger(__name__)

# Keyword arguments other backends' get functions take (DaskVine, distributed,
# dask.local). Accepted so that scripts run unchanged; raydag decides these itself.
FOREIGN_KWARGS = frozenset(
    {
        "resources",
        "prune_depth",
        "worker_transfers",
        "task_mode",
        "lib_resources",
        "extra_files",
        "env_vars",
        "wrapper",
        "wrapper_proc",
        "lazy_transfers",
        "submit_per_cycle",
        "max_pending",
        "hoisting_modules",
        "import_modules",
        "progress_disable",
        "progress_label",
        "reconstruct",
        "merge_size",
        "low_memory_mode",
        "checkpoint_fn",
        "num_workers",
        "pool",
        "chunksize",
        "get_id",
        "rerun_exceptions_locally",
        "workers",
        "allow_other_workers",
        "retries",
        "priority",
        "fifo_timeout",
        "actors",
        "sync",
        "asynchronous",
        "direct",
        "optimize_graph",
    }
)


class IgnoredArgumentsWarning(UserWarning):
    """A keyword argument meant for another scheduler was accepted and ignored."""


def ray_get(dsk: Any, keys: Any, callbacks: Any = None, **kwargs: Any) -> Any:
    """A dask scheduler ``get`` that runs the graph on Ray.

    ``dask.compute(x, scheduler=raydag.ray_get)``. Results come back in the nested
    structure of ``keys``; a task's exception is raised with its own type and traceback.

    Ray's Dask-on-Ray keywords (``ray.util.dask.ray_dask_get``'s) work the same way:
    ``ray_remote_args`` (Ray task options for every task, under the tasks'
    ``dask.annotate(ray_remote_args=...)``), ``ray_callbacks`` (``RayDaskCallback``s in
    place of the active ones), ``ray_persist=True`` (the outputs' ``ray.ObjectRef``s,
    not their values) and ``_ray_enable_progress_bar`` (raydag's progress display).
    """
    ray_kw = _ray_keywords(kwargs)
    _warn_ignored(kwargs)
    return _get(dsk, keys, callbacks, **ray_kw)


def _get(
    dsk: Any,
    keys: Any,
    callbacks: Any,
    keep: bool = False,
    ray_persist: bool = False,
    ray_callbacks: Any = None,
    ray_remote_args: Any = None,
    progress_bar: bool = False,
) -> Any:
    """Run; return the outputs' values, or (``keep``) ``Persisted`` results, or (Ray's
    ``ray_persist``) plain ObjectRefs; ``_ray_finish`` hooks get what is returned."""
    show = dask.config.set({"raydag.progress.enabled": True}) if progress_bar else nullcontext()
    with ray_hooks.active(keys, ray_callbacks) as hooks, show:
        graph, outputs = runtime.run(dsk, keys, callbacks, ray_remote_args, hooks)
        if ray_persist:  # Ray's form: plain refs, which dask may inline into later tasks
            handed_out[0] = True
            result = runtime.nested(keys, {k: ref for k, (ref, _) in outputs.items()})
        elif keep:
            persisted = {
                k: runtime.Persisted(k, ref, node, graph.tasks)
                for k, (ref, node) in outputs.items()
            }
            result = runtime.nested(keys, persisted)
        else:
            result = runtime.nested(keys, _fetch(outputs))
        outputs.clear()
        if hooks is not None:
            hooks.finished(result)
    return result


def _fetch(outputs: dict) -> dict:
    """The outputs' values, owned (``own``); ``outputs`` emptied (the refs let go)."""
    try:
        refs = [ref for ref, _ in outputs.values()]
        return {k: own(v) for k, v in zip(outputs, runtime.ray.get(refs), strict=True)}
    except runtime.ray.exceptions.RayError as e:  # an output lost since: see ``frameless``
        raise runtime.frameless(e)  # noqa: B904  (the same error, without Ray's frames)
    finally:
        outputs.clear()
        del refs


# Ray's Dask-on-Ray keywords of a get (``ray.util.dask.ray_dask_get``) -> ``_get``'s.
RAY_KEYWORDS = {
    "ray_persist": "ray_persist",
    "ray_callbacks": "ray_callbacks",
    "ray_remote_args": "ray_remote_args",
    "_ray_enable_progress_bar": "progress_bar",
}


def _ray_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {ours: kwargs.pop(theirs) for theirs, ours in RAY_KEYWORDS.items() if theirs in kwargs}


# Ray hands numpy and pandas data back as read-only views into its object store,
# which stay pinned there while the user holds them. dask's schedulers return plain,
# writeable objects; so does raydag, with one copy, and the store is left empty.
own = Dispatch("own")


@own.register(object)
def _own_object(x: Any) -> Any:
    return x


@own.register(list)
def _own_list(x: list) -> list:
    return [own(v) for v in x]


@own.register(tuple)
def _own_tuple(x: tuple) -> tuple:
    return type(x)(*map(own, x)) if hasattr(x, "_fields") else tuple(map(own, x))


@own.register(dict)
def _own_dict(x: dict) -> dict:
    return {k: own(v) for k, v in x.items()}


@own.register_lazy("numpy")
def _register_numpy() -> None:
    import numpy as np

    @own.register(np.ndarray)
    def _own_ndarray(x: np.ndarray) -> np.ndarray:
        return x if x.flags.writeable else x.copy()


@own.register_lazy("pandas")
def _register_pandas() -> None:
    import pandas as pd

    @own.register((pd.DataFrame, pd.Series, pd.Index))
    def _own_pandas(x: Any) -> Any:
        # What pandas takes for immutable, copy() shares, and it may point into the
        # object store: indexes (pandas 3's string column labels are arrow-backed) and
        # arrow-backed columns. Those are copied again, arrow buffers by pickling.
        if isinstance(x, pd.Index):
            return _own_index(x)
        x = x.copy(deep=True)
        if isinstance(x, pd.DataFrame):
            if any(_arrow(d) for d in x.dtypes):
                x = pickle.loads(pickle.dumps(x))
            x.columns = _own_index(x.columns)
        elif _arrow(x.dtype):
            x = pickle.loads(pickle.dumps(x))
        x.index = _own_index(x.index)
        return x

    def _own_index(index: pd.Index) -> pd.Index:
        dtypes = index.dtypes if isinstance(index, pd.MultiIndex) else [index.dtype]
        if any(_arrow(d) for d in dtypes):
            return pickle.loads(pickle.dumps(index))
        return index.copy(deep=True)

    def _arrow(dtype: Any) -> bool:
        return isinstance(dtype, pd.ArrowDtype) or str(getattr(dtype, "storage", "")).startswith(
            "pyarrow"
        )


def _persisted_get(dsk: Any, keys: Any, callbacks: Any = None, **kwargs: Any) -> Any:
    """Like ``ray_get`` but leaves results in Ray's object store, with their lineage
    (with Ray's ``ray_persist=True``: plain ObjectRefs, as ``ray_dask_get`` returns)."""
    ray_kw = _ray_keywords(kwargs)
    _warn_ignored(kwargs)
    return _get(dsk, keys, callbacks, keep=True, **ray_kw)


def persist(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``dask.persist`` whose results stay in Ray's object store.

    The returned collections hold ``Persisted`` ObjectRefs in their graphs; computing
    them with raydag reads those objects where they are, recomputes any that a dead
    node (or an earlier Ray session) took with it, and dropping the collections frees
    them. Returns a tuple, one collection per argument, as ``dask.persist`` does:
    ``(x2,) = raydag.persist(x)``.
    """
    kwargs.pop("scheduler", None)
    return dask.persist(*args, scheduler=_persisted_get, **kwargs)


def _persist_collections(
    collections: Sequence[Any], optimize_graph: bool = True, **kwargs: Any
) -> list[Any]:
    """dask's hook for a scheduler's own persist: ``dask.persist`` (and ``x.persist()``)
    with ``scheduler=raydag.ray_get`` hands the collections here, as to a distributed
    Client's ``persist``. dask releases without the hook (2025.3.x) compute the values
    back to the driver instead; ``raydag.persist`` keeps them in Ray on every release."""
    kwargs.pop("traverse", None)
    return list(
        dask.persist(
            *collections,
            scheduler=_persisted_get,
            optimize_graph=optimize_graph,
            traverse=False,
            **kwargs,
        )
    )


ray_get.persist = _persist_collections  # type: ignore[attr-defined]

get = ray_get


# ---- raydag.enable() -------------------------------------------------------------------


class Enabled:
    """What one ``raydag.enable()`` changed, to undo it: ``disable()``, or the end of
    ``with raydag.enable():``.

    Each setting gets back the value it had before (or none, if it had none), unless
    something else has set it since: only what ``enable`` changed is undone.
    """

    def __init__(self, settings: dict[str, Any], installed: bool) -> None:
        self.settings = dict(settings)  # what it set
        # one dask setter per setting: its exit puts back that setting's old value
        self._setters = {k: dask.config.set({k: v}) for k, v in settings.items()}
        self._installed = installed  # the shuffle's dask-expr hook: removed with the last
        self.active = True

    def undo(self) -> None:
        """Put back what this ``enable()`` changed (again: nothing)."""
        with _lock:
            if not self.active:
                return
            self.active = False
            _enabled.remove(self)
            for key, setter in self._setters.items():
                if dask.config.get(key, None) != self.settings[key]:
                    logger.debug("raydag: %s was set again since enable(); left as it is", key)
                    continue
                setter.__exit__(None, None, None)
            if self._installed:
                if _enabled:  # still enabled: the last of them removes the hook
                    _enabled[-1]._installed = True
                else:
                    from raydag import shuffle

                    shuffle.uninstall()

    def __enter__(self) -> Enabled:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<raydag.Enabled ({state}): {', '.join(self.settings)}>"


_lock = threading.RLock()
_enabled: list[Enabled] = []  # the enables not undone yet, oldest first


def enable(*, shuffle: bool = True) -> Enabled:
    """Make raydag dask's scheduler, and its shuffle dask's shuffle, until ``disable()``.

    It changes two of dask's settings:

    - ``scheduler``, to ``raydag.ray_get``: every ``compute`` runs on Ray, and so does
      every ``persist``, whose results stay in Ray's object store as with
      ``raydag.persist`` (on dask releases that let a scheduler take over ``persist``;
      dask 2025.3.x brings them back to the driver's memory);
    - with ``shuffle``, ``dataframe.shuffle.method``, to ``"raydag"`` (``raydag.shuffle``),
      whose dask-expr hook it installs if ``raydag.shuffle.install()`` has not. Call it
      before building dataframe collections: dask picks some shuffles as it builds them.

    ``raydag.disable()`` undoes it, and so does the end of ``with raydag.enable(): ...``:
    each setting gets back the value it had before (not dask's default; none if it had
    none) unless something else has set it since, and the hook goes if this put it in.
    """
    from raydag import shuffle as _shuffle

    return _enable({SHUFFLE_METHOD: _shuffle.METHOD} if shuffle else {})


SHUFFLE_METHOD = "dataframe.shuffle.method"


def _enable(settings: dict[str, Any]) -> Enabled:
    """raydag as dask's scheduler, and ``settings`` (raydag's shuffle method: its
    dask-expr hook installed)."""
    from raydag import shuffle as _shuffle

    settings = {"scheduler": ray_get, **settings}
    with _lock:
        installed = settings.get(SHUFFLE_METHOD) == _shuffle.METHOD and not _shuffle.installed()
        if installed:
            _shuffle.install()
        handle = Enabled(settings, installed)
        _enabled.append(handle)
    logger.debug("raydag enabled: %s", handle)
    return handle


def enable_dask_on_ray(
    shuffle: str | None = "tasks", use_shuffle_optimization: bool | None = True
) -> Enabled:
    """Ray's ``ray.util.dask.enable_dask_on_ray``, on raydag: ``raydag.enable()`` under
    Ray's name and arguments, usable for good or as a context manager.

    Ray sets dask's scheduler to ``ray_dask_get``, dask's shuffle to ``shuffle``, and with
    ``use_shuffle_optimization`` rewrites dask's task shuffle into its own, whose maps
    return one Ray object per output partition. Here: raydag is the scheduler; with
    ``shuffle="tasks"`` and ``use_shuffle_optimization`` (Ray's defaults), raydag's
    shuffle is dask's method (the same idea as Ray's rewrite); otherwise ``shuffle`` is
    dask's ``dataframe.shuffle.method`` as given (``"tasks"``, ``"disk"``; ``None``: dask
    picks). ``disable_dask_on_ray()``, ``raydag.disable()`` or the end of the ``with``
    undo it.
    """
    from raydag import shuffle as _shuffle

    if shuffle == "tasks" and use_shuffle_optimization:
        return _enable({SHUFFLE_METHOD: _shuffle.METHOD})
    return _enable({SHUFFLE_METHOD: shuffle})


def disable() -> None:
    """Undo every ``raydag.enable()`` not undone yet, the latest first.

    dask's ``scheduler`` and ``dataframe.shuffle.method`` get back the values they had
    before the first of them (none, if they had none), except a setting changed since
    by something else, which is left as it is. Nothing happens if raydag is not enabled.
    """
    with _lock:
        for handle in reversed(list(_enabled)):
            handle.undo()


def disable_dask_on_ray() -> None:
    """Ray's ``ray.util.dask.disable_dask_on_ray``, on raydag: ``raydag.disable()``.

    Ray's sets dask's scheduler and shuffle to ``None`` for good; this undoes every
    ``enable_dask_on_ray()`` and ``raydag.enable()``, putting back what they changed.
    """
    disable()


# Ray's names for the get (``ray_dask_get_sync``: Ray's without its submitting thread
# pool; raydag's get has none).
ray_dask_get = ray_get
ray_dask_get_sync = ray_get


def ray_dask_persist(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """Ray's ``ray.util.dask.ray_dask_persist`` on raydag: ``dask.persist`` on raydag
    with ``ray_persist=True``; the collections' graphs hold plain ``ray.ObjectRef``s
    (Ray's form: no lineage, so a lost one is not recomputed; ``raydag.persist``'s are)."""
    return persist(*args, ray_persist=True, **kwargs)


def _warn_ignored(kwargs: dict[str, Any]) -> None:
    kwargs.pop("callbacks", None)
    if kwargs:
        names = ", ".join(sorted(kwargs))
        unknown = set(kwargs) - FOREIGN_KWARGS
        hint = f" (not known to any backend: {', '.join(sorted(unknown))})" if unknown else ""
        warnings.warn(
            f"raydag ignores these keyword arguments: {names}{hint}",
            IgnoredArgumentsWarning,
            stacklevel=3,
        )
