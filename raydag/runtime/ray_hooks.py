"""Ray's ``RayDaskCallback`` hooks (``ray.util.dask``), called by raydag at the moments
Ray documents them.

The callbacks are Ray's own: a ``RayDaskCallback`` subclass entered with ``with cb:``
(or ``cb.register()``), or the ``ray_callbacks=`` keyword of the compute (callbacks or
their ``RayCallback`` tuples) in their place. During the compute the active set is
emptied (Ray's ``local_ray_callbacks``), so a compute nested in a task does not call
them, and put back afterwards. A hook left as ``RayDaskCallback`` defines it does
nothing and is not called (nor shipped to the workers).

| hook | where, when |
| --- | --- |
| ``_ray_presubmit(task, key, deps)`` | driver, before each dask task's Ray task is submitted; the first non-``None`` return of the callbacks is the task's value: nothing runs, dependents read it (raydag puts it in the object store) |
| ``_ray_postsubmit(task, key, deps, object_ref)`` | driver, after each submission, per dask task of the Ray task |
| ``_ray_pretask(key, object_refs)`` | the worker, before each dask task runs; ``object_refs``: its dependencies' values |
| ``_ray_posttask(key, result, pre_state)`` | the worker, after it returned; ``pre_state``: that callback's pretask return |
| ``_ray_postsubmit_all(object_refs, dsk)`` | driver, once every task the outputs need has been submitted |
| ``_ray_finish(result)`` | driver, once, with the outputs' values (``ray_persist=True``: their refs) |

Fused groups (one Ray task running several dask tasks): pre/posttask fire per dask
task, inside the worker; postsubmit per dask task, with the ObjectRef of the Ray task
that computes it (its own value when the group keeps it, else the group's last), and
so do ``deps`` of dependencies computed in the same Ray task. A presubmit hook turns
fusion and bundles off for its compute: its contract (a value in place of one dask
task) is per dask task, decided before the task is submitted (docs/semantics.md).

Worked example: ``with Counting(): add(2, 3).compute(scheduler=raydag.ray_get)``, one
task ``add``: presubmit (``None``) -> the Ray task is submitted -> postsubmit with its
ref -> postsubmit_all with ``[ref]`` -> in the worker, pretask then posttask with ``5``
-> finish with ``[5]``.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from raydag import compat

Key = Hashable

# Each hook's parameters (after self), as Ray calls them.
HOOK_PARAMETERS = {
    "ray_presubmit": ("task", "key", "deps"),
    "ray_postsubmit": ("task", "key", "deps", "object_ref"),
    "ray_pretask": ("key", "object_refs"),
    "ray_posttask": ("key", "result", "pre_state"),
    "ray_postsubmit_all": ("object_refs", "dsk"),
    "ray_finish": ("result",),
}


@dataclass
class RayHooks:
    """The hooks of one compute, each list in the callbacks' order."""

    keys: Any  # the get's keys: the nesting of postsubmit_all's and finish's results
    presubmit: list = field(default_factory=list)
    postsubmit: list = field(default_factory=list)
    # (pretask, posttask) of each callback with either; shipped to the workers
    worker: list = field(default_factory=list)
    postsubmit_all: list = field(default_factory=list)
    finish: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.presubmit or self.postsubmit or self.worker or self.postsubmit_all or self.finish
        )

    def presubmitted(self, task: Any, key: Key, deps: dict) -> Any:
        """Every presubmit hook's return; the first not ``None`` (or ``None``)."""
        values = [hook(task, key, deps) for hook in self.presubmit]
        return next((v for v in values if v is not None), None)

    def submitted(self, task: Any, key: Key, deps: dict, object_ref: Any) -> None:
        for hook in self.postsubmit:
            hook(task, key, deps, object_ref)

    def submitted_all(self, refs: Mapping[Key, Any], dsk: Mapping) -> None:
        outputs = nested(self.keys, refs)
        for hook in self.postsubmit_all:
            hook(outputs, dsk)

    def finished(self, result: Any) -> None:
        for hook in self.finish:
            hook(result)


@contextlib.contextmanager
def active(keys: Any, ray_callbacks: Iterable[Any] | None = None) -> Iterator[RayHooks | None]:
    """The compute's hooks (``None``: none), with Ray's active set emptied meanwhile."""
    module = compat.ray_dask_callbacks()
    if module is None:
        if ray_callbacks:  # nothing can be a RayCallback without ray.util.dask
            raise TypeError(
                "ray_callbacks must hold ray.util.dask.RayDaskCallback instances or their "
                f"RayCallback tuples; got {list(ray_callbacks)!r}"
            )
        yield None
        return
    given = None if ray_callbacks is None else [_normalised(module, c) for c in ray_callbacks]
    with module.local_ray_callbacks(given) as callbacks:
        hooks = _hooks(module, keys, callbacks)
        yield hooks if hooks else None


def _normalised(module: Any, callback: Any) -> Any:
    if isinstance(callback, module.RayDaskCallback):
        return callback._ray_callback
    if isinstance(callback, module.RayCallback):
        return callback
    raise TypeError(
        "ray_callbacks must hold ray.util.dask.RayDaskCallback instances or RayCallback "
        f"tuples, not {type(callback).__name__}: {callback!r}"
    )


def _hooks(module: Any, keys: Any, callbacks: Iterable[Any]) -> RayHooks:
    hooks = RayHooks(keys)
    for cb in callbacks:
        found = {name: _hook(module, cb, name) for name in HOOK_PARAMETERS}
        for name, lst in (
            ("ray_presubmit", hooks.presubmit),
            ("ray_postsubmit", hooks.postsubmit),
            ("ray_postsubmit_all", hooks.postsubmit_all),
            ("ray_finish", hooks.finish),
        ):
            if found[name] is not None:
                lst.append(found[name])
        pre, post = found["ray_pretask"], found["ray_posttask"]
        if pre is not None or post is not None:
            hooks.worker.append((pre, post))
    return hooks


def _hook(module: Any, callback: Any, name: str) -> Callable | None:
    """The callback's hook, checked against the arguments Ray passes; ``None`` if it
    has none or only ``RayDaskCallback``'s own, which does nothing."""
    fn = getattr(callback, name, None)
    if fn is None:
        return None
    if getattr(fn, "__func__", None) is getattr(module.RayDaskCallback, "_" + name, None):
        return None
    params = HOOK_PARAMETERS[name]
    if not callable(fn):
        raise TypeError(f"RayDaskCallback hook _{name} is not callable: {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: let the call tell
        return fn
    try:
        signature.bind(*params)
    except TypeError as e:
        owner = getattr(getattr(fn, "__self__", None), "__class__", None)
        where = f" of {owner.__qualname__}" if owner is not None else ""
        raise TypeError(
            f"RayDaskCallback hook _{name}{where} must take ({', '.join(params)}), "
            f"as Ray calls it; it is {getattr(fn, '__name__', fn)!s}{signature}: {e}"
        ) from None
    return fn


def nested(keys: Any, values: Mapping[Key, Any]) -> Any:
    """``values`` in the nesting of a get's ``keys`` (lists of lists of keys)."""
    if isinstance(keys, list):
        return [nested(k, values) for k in keys]
    return values[keys]
