"""What runs in raydag's shuffle tasks: the map's split, a piece, the reducer's concat.

See ``raydag.shuffle`` for the graph's shape and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from raydag import config

MAP = "raydag-shuffle-map-"
PIECE = "raydag-shuffle-piece-"


class IncompatiblePartitionError(ValueError):
    """A partition entering the shuffle does not have the columns its collection says."""


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
