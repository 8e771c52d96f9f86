"""raydag's shuffle as a dask-expr expression (imports dask.dataframe: loaded on demand).

See ``raydag.shuffle`` for the graph's shape and why.
"""

from __future__ import annotations

import functools
from typing import Any

from raydag.compat import List, SimpleShuffle, Task, TaskRef
from raydag.shuffle.tasks import MAP, PIECE, concat, inputs_per_map, piece, split


class RaydagShuffle(SimpleShuffle):
    """N maps with M pieces each, M concatenations of piece j of every map."""

    @functools.cached_property
    def _meta(self) -> Any:
        meta = self.frame._meta
        return meta.reset_index(drop=True) if self.ignore_index else meta

    def _layer(self) -> dict:
        name = self._name
        maps, pieces = MAP + name, PIECE + name
        nin = self.frame.npartitions
        nout = self.npartitions_out
        meta = self.frame._meta
        columns = tuple(meta.columns) if hasattr(meta, "columns") else None
        per = inputs_per_map(nin, nout)
        nmaps = -(-nin // per)
        dsk: dict = {}
        for i in range(nmaps):
            key = (maps, i)
            ins = range(i * per, min(nin, (i + 1) * per))
            dsk[key] = Task(
                key,
                split,
                List(*(TaskRef((self.frame._name, n)) for n in ins)),
                self.partitioning_index,
                nout,
                self.ignore_index,
                columns,
                (name, ins[0]),
            )
        for out, j in enumerate(self._partitions):
            for i in range(nmaps):
                k = (pieces, j, i)
                dsk[k] = Task(k, piece, TaskRef((maps, i)), j)
            refs = List(*(TaskRef((pieces, j, i)) for i in range(nmaps)))
            dsk[(name, out)] = Task((name, out), concat, refs, self.ignore_index)
        return dsk
