"""What users call: a dask scheduler ``get`` and a ``persist`` that keeps results in Ray."""

from __future__ import annotations

import logging
import pickle
import warnings
from typing import Any

import dask
from dask.utils import Dispatch

from raydag import runtime

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
    """
    _warn_ignored(kwargs)
    _, outputs = runtime.run(dsk, keys, callbacks=callbacks)
    try:
        refs = [ref for ref, _ in outputs.values()]
        values = {k: own(v) for k, v in zip(outputs, runtime.ray.get(refs), strict=True)}
    except runtime.ray.exceptions.RayError as e:  # an output lost since: see ``frameless``
        raise runtime.frameless(e)  # noqa: B904  (the same error, without Ray's frames)
    finally:
        outputs.clear()
        del refs
    return runtime.nested(keys, values)


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


get = ray_get


def _persisted_get(dsk: Any, keys: Any, callbacks: Any = None, **kwargs: Any) -> Any:
    """Like ``ray_get`` but leaves results in Ray's object store, with their lineage."""
    _warn_ignored(kwargs)
    graph, outputs = runtime.run(dsk, keys, callbacks=callbacks)
    values = {k: runtime.Persisted(k, ref, node, graph.tasks) for k, (ref, node) in outputs.items()}
    return runtime.nested(keys, values)


def persist(*args: Any, **kwargs: Any) -> Any:
    """``dask.persist`` whose results stay in Ray's object store.

    The returned collections hold ``Persisted`` ObjectRefs in their graphs; computing
    them with raydag reads those objects where they are, recomputes any that a dead
    node took with it, and dropping the collections frees them.
    Returns one collection for one argument, a tuple otherwise, as ``dask.persist``.
    """
    kwargs.pop("scheduler", None)
    results = dask.persist(*args, scheduler=_persisted_get, **kwargs)
    return results[0] if len(args) == 1 else results


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
