"""Results that ``raydag.persist`` keeps in Ray's object store, found again by key."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Hashable, Mapping
from typing import Any

import ray

from raydag.compat import TaskRef
from raydag.runtime.cluster import session

Key = Hashable


class Persisted(TaskRef):
    """A result that ``raydag.persist`` keeps in Ray's object store.

    It stands in a persisted collection's graph in place of the value. Being a
    ``TaskRef`` (as distributed's ``Future`` is), dask's optimisations treat it as a
    reference to its key rather than as data to inline. It carries the tasks that
    made it, so a later compute can recompute it if its node dies, and it is updated
    in place when that happens. ``session``: the Ray session its ref belongs to; after
    ``ray.shutdown()`` and a new ``ray.init()`` the value is gone with the old cluster,
    and a compute that reads it recomputes it too (see ``gone``).
    """

    __slots__ = ("ref", "node", "lineage", "session", "__weakref__")

    def __init__(self, key: Key, ref: ray.ObjectRef, node: str | None, lineage: Mapping):
        super().__init__(key)
        self.ref = ref
        self.node = node
        self.lineage = lineage
        self.session = session()
        _persisted.setdefault(key, []).append(weakref.ref(self, functools.partial(_forget, key)))

    def heal(self, ref: ray.ObjectRef, node: str | None) -> None:
        """Recomputed after a loss: the new value, in this Ray session."""
        self.ref, self.node, self.session = ref, node, session()

    def __repr__(self) -> str:
        return f"Persisted({self.key!r}, {self.ref.hex()[:16]})"


# Live persisted results by key: a later graph refers to them only by key. A key has
# several when a collection was persisted more than once; any live one will do.
_persisted: dict[Key, list[weakref.ref]] = {}


def _forget(key: Key, dead: weakref.ref) -> None:
    refs = _persisted.get(key)
    if refs is not None:
        refs[:] = [r for r in refs if r is not dead and r() is not None]
        if not refs:
            _persisted.pop(key, None)


def find_persisted(key: Key) -> Persisted | None:
    """A live persisted result of ``key``: one of this Ray session if there is one."""
    found = [p for r in _persisted.get(key, ()) if (p := r()) is not None]
    if len(found) > 1:
        now = session()
        found.sort(key=lambda p: p.session != now)
    return found[0] if found else None


def gone(external: Mapping[Key, Any]) -> list[Key]:
    """The given values made in an earlier Ray session (``ray.shutdown()``, then a new
    ``ray.init()``): their objects went with that cluster, and their refs must never
    reach a task (Ray fails the submit: their owner is unknown)."""
    if not any(isinstance(v, Persisted) for v in external.values()):
        return []
    now = session()
    return [k for k, v in external.items() if isinstance(v, Persisted) and v.session != now]


# Has this process handed out plain ObjectRefs as persisted values (``ray_persist=True``)?
# dask may then inline them into the tasks of later graphs, where the workers read them
# (``worker.resolve_inlined_refs``); until then no task is searched for them.
handed_out = [False]


def given_ref(value: Any) -> ray.ObjectRef:
    return value.ref if isinstance(value, Persisted) else value


def is_given(value: Any) -> bool:
    return isinstance(value, Persisted | ray.ObjectRef)
