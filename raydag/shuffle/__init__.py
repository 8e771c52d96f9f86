"""A dask.dataframe shuffle for Ray: N map tasks, each making M pieces, and M reducers.

Without a distributed Client, dask shuffles with its "disk" method: a partd directory
on the local disk of whichever node ran the task, which on several nodes loses rows
without an error. Its "tasks" method makes about N x M tasks. This one is a plain dask
graph (it computes under any scheduler, ``sync`` included):

- ``(raydag-shuffle-map-<name>, i)`` splits input partitions ``i*k`` to ``i*k+k-1``
  (k consecutive ones, see ``inputs_per_map``; one unless the pieces would be many)
  into M pieces;
- ``(raydag-shuffle-piece-<name>, j, i)`` takes piece ``j`` of map ``i``;
- ``(<name>, j)`` concatenates piece ``j`` of every map, in input order (so the order
  of rows within a key is kept, as drop_duplicates' keep="first"/"last" needs).

raydag recognises the maps by their key name and runs each map with its pieces as
one Ray task returning each piece as its own object (``num_returns``): N/k + M Ray
tasks, each reducer fetching only its pieces. A lost piece is recomputed by running
its map again, keeping only the lost pieces (see ``raydag.core.bundles``).

Turn it on with ``raydag.shuffle.enable()`` before building collections (dask
resolves the shuffle method while optimising, and drop_duplicates/unique when the
collection is built).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import dask

from raydag.core import bundles as _bundles
from raydag.shuffle.tasks import (  # noqa: F401  (the shuffle's names, in one place)
    MAP,
    PIECE,
    IncompatiblePartitionError,
    concat,
    inputs_per_map,
    piece,
    split,
)

METHOD = "raydag"

logger = logging.getLogger(__name__)

Key = Hashable


def _name(key: Key) -> str | None:
    return key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else None


@_bundles.register
def bundles(
    tasks: Iterable[Key], dependents: Mapping[Key, Iterable[Key]]
) -> dict[Key, tuple[Key, ...]]:
    """Each shuffle map of a graph with the pieces read from it: its bundles for the
    state machine (``raydag.core.bundles``), registered as a finder on import."""
    out = {}
    for k in tasks:
        name = _name(k)
        if name is None or not name.startswith(MAP):
            continue
        pieces = sorted(dependents[k], key=lambda p: p[1:] if _name(p) else (p,))
        if pieces and all((_name(p) or "").startswith(PIECE) for p in pieces):
            out[k] = tuple(pieces)
    return out


# ---- the dask-expr side ----------------------------------------------------------------


# dask-expr's own ``Shuffle._lower`` and raydag's wrapper of it, while the hook is in
_original: Any = None
_wrapper: Any = None


def installed() -> bool:
    """Is dask-expr's ``"raydag"`` shuffle method installed (``install``)?"""
    return _original is not None


def install() -> None:
    """Teach dask-expr the ``"raydag"`` shuffle method (idempotent).

    dask has no hook for a third-party shuffle: ``Shuffle._lower`` picks the
    expression by the method's name, so it is wrapped to pick ``RaydagShuffle`` for
    ``"raydag"`` and leave every other method to dask. ``uninstall`` unwraps it.
    """
    global _original, _wrapper
    if _original is not None:
        return
    from dask.utils import get_default_shuffle_method

    from raydag.compat import Shuffle

    original = Shuffle._lower

    @functools.wraps(original)
    def _lower(self: Any) -> Any:
        if (self.method or get_default_shuffle_method()) != METHOD:
            return original(self)
        from raydag.shuffle.expr import RaydagShuffle

        return RaydagShuffle(
            self.frame,
            self.partitioning_index,
            self.npartitions_out,
            self.ignore_index,
            self.options,
            self.original_partitioning_index,
        )

    Shuffle._lower = _wrapper = _lower
    _original = original


def uninstall() -> None:
    """Give dask-expr back its own ``Shuffle._lower`` (what ``raydag.disable()`` does,
    when its ``enable()`` installed it). Nothing happens if it is not installed."""
    global _original, _wrapper
    if _original is None:
        return
    from raydag.compat import Shuffle

    if Shuffle.__dict__.get("_lower") is _wrapper:  # not wrapped again by someone else
        Shuffle._lower = _original
    else:
        logger.warning("raydag: dask-expr's Shuffle._lower was replaced since; left as it is")
    _original = _wrapper = None


def enable(scheduler: bool = True) -> Any:
    """Use raydag's shuffle for every dask.dataframe shuffle from now on.

    Call it before building the collections. It sets dask's
    ``dataframe.shuffle.method`` to ``"raydag"`` and, with ``scheduler``, makes
    raydag dask's scheduler too, so that the divisions pass of ``set_index`` and
    ``sort_values`` (a ``compute`` dask runs while optimising, which only sees the
    configured scheduler) runs on Ray as well. Returns dask's config setter: use it
    as a context manager to turn everything back afterwards.
    """
    install()
    settings: dict[str, Any] = {"dataframe.shuffle.method": METHOD}
    if scheduler:
        from raydag.api import ray_get

        settings["scheduler"] = ray_get
    return dask.config.set(settings)
