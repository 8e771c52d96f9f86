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
its map again, keeping only the lost pieces (see ``raydag.state``, bundles).

Turn it on with ``raydag.shuffle.enable()`` before building collections (dask
resolves the shuffle method while optimising, and drop_duplicates/unique when the
collection is built).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import dask

from raydag import config

METHOD = "raydag"
MAP = "raydag-shuffle-map-"
PIECE = "raydag-shuffle-piece-"

Key = Hashable


class IncompatiblePartitionError(ValueError):
    """A partition entering the shuffle does not have the columns its collection says."""


def _name(key: Key) -> str | None:
    return key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else None


def bundles(
    tasks: Iterable[Key], dependents: Mapping[Key, Iterable[Key]]
) -> dict[Key, tuple[Key, ...]]:
    """Each shuffle map of a graph with the pieces read from it: ``State``'s bundles."""
    out = {}
    for k in tasks:
        name = _name(k)
        if name is None or not name.startswith(MAP):
            continue
        pieces = sorted(dependents[k], key=lambda p: p[1:] if _name(p) else (p,))
        if pieces and all((_name(p) or "").startswith(PIECE) for p in pieces):
            out[k] = tuple(pieces)
    return out


# ---- what runs in the tasks ----------------------------------------------------------


def split(
    dfs: list,
    column: str,
    npartitions: int,
    ignore_index: bool,
    columns: tuple | None,
    label: tuple,
) -> dict[int, Any]:
    """The map: the rows of input partitions ``dfs`` (consecutive, in order) split by
    their output partition (the ``column``'s values)."""
    from dask.dataframe.shuffle import shuffle_group

    name, first = label
    for i, df in enumerate(dfs):
        if columns is not None and tuple(df.columns) != columns:
            missing = [c for c in columns if c not in df.columns]
            extra = [c for c in df.columns if c not in columns]
            raise IncompatiblePartitionError(
                f"shuffle {name!r}: input partition {first + i} has columns "
                f"{list(df.columns)}, but the collection's metadata says {list(columns)} "
                f"(missing {missing}, unexpected {extra}); a map_partitions or read "
                "that returns other columns than its meta cannot be shuffled"
            )
    df = dfs[0] if len(dfs) == 1 else _concat_inputs(dfs)
    return shuffle_group(df, column, 0, npartitions, npartitions, ignore_index, npartitions)


def _concat_inputs(dfs: list) -> Any:
    from dask.dataframe import methods

    nonempty = [df for df in dfs if len(df)] or dfs[:1]
    return nonempty[0] if len(nonempty) == 1 else methods.concat(nonempty, uniform=True)


def inputs_per_map(nin: int, nout: int) -> int:
    """How many consecutive input partitions each map reads: ``raydag.shuffle.inputs-per-map``.

    ``auto``: one, unless the maps' pieces (maps x ``nout``) would pass
    ``raydag.shuffle.max-pieces``; then as few more as keep them under it, but never so
    many that there are fewer maps than twice the CPUs of the Ray cluster raydag is
    connected to (if it is). Every piece is a Ray object, and each costs the driver,
    the raylet and both workers about the same whatever its size: 64 x 64 pieces of
    about 100 KB cost two to three times the CPU of the data's own work.
    """
    value = config.get("shuffle.inputs-per-map")
    if value != "auto":
        return min(_positive("shuffle.inputs-per-map", value, "'auto' or "), nin)
    budget = _positive("shuffle.max-pieces", config.get("shuffle.max-pieces"))
    per = max(1, -(-nin * nout // budget))
    cpus = _cluster_cpus()
    if cpus:
        per = min(per, max(1, nin // (2 * cpus)))
    return min(per, nin)


def _positive(name: str, value: Any, also: str = "") -> int:
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise ValueError(f"raydag.{name} must be {also}a positive integer, not {value!r}")
    return int(value)


def _cluster_cpus() -> int:
    """The CPUs of the Ray cluster this process is connected to; 0 if none (yet)."""
    import ray

    if not ray.is_initialized():
        return 0
    try:
        return int(ray.cluster_resources().get("CPU", 0))
    except Exception:  # a cluster that cannot say: no cap
        return 0


def piece(parts: Mapping[int, Any], j: int) -> Any:
    return parts[j]


def concat(pieces: list, ignore_index: bool) -> Any:
    """The reducer: piece ``j`` of every map, in input order."""
    from raydag.compat import dataframe_concat

    return dataframe_concat(pieces, ignore_index)


# ---- the dask-expr side ----------------------------------------------------------------


_installed = False


def install() -> None:
    """Teach dask-expr the ``"raydag"`` shuffle method (idempotent).

    dask has no hook for a third-party shuffle: ``Shuffle._lower`` picks the
    expression by the method's name, so it is wrapped to pick ``RaydagShuffle`` for
    ``"raydag"`` and leave every other method to dask.
    """
    global _installed
    if _installed:
        return
    from dask.utils import get_default_shuffle_method

    from raydag.compat import Shuffle

    original = Shuffle._lower

    @functools.wraps(original)
    def _lower(self: Any) -> Any:
        if (self.method or get_default_shuffle_method()) != METHOD:
            return original(self)
        from raydag.shuffle_expr import RaydagShuffle

        return RaydagShuffle(
            self.frame,
            self.partitioning_index,
            self.npartitions_out,
            self.ignore_index,
            self.options,
            self.original_partitioning_index,
        )

    Shuffle._lower = _lower
    _installed = True


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
