"""Bundles: one Ray task that keeps several values, each its own Ray object.

A shuffle's map splits its input into M pieces read by M reducers. Run as dask tasks,
the map's value (all M pieces) would go to the object store and each reducer would
fetch all of it. As a bundle, the map runs with its pieces in one Ray task that returns
each piece as its own object (``num_returns``): each reducer fetches its piece alone,
and each piece is held, released, lost and recomputed on its own. After a loss the map
runs again keeping only the pieces still needed.

Which keys are bundles is not the core's to know: an integration registers a
*finder* (``register``), a function of the graph's tasks and dependents returning
``{map: pieces}``; ``find`` asks them all. The state machine then keeps only what can
run as a bundle: a map whose dependents are exactly its pieces, each piece reading only
the map, the map no output and no given value.

Worked example: ``map-0`` with pieces ``piece-0-0 .. piece-0-2``, read by ``out-0 ..
out-2``. ``map-0`` ready: the group is ``(map-0, piece-0-0, piece-0-1, piece-0-2)``, kept
``(piece-0-0, piece-0-1, piece-0-2)``. ``piece-0-1`` is lost later while ``out-1``
still needs it: the group is ``(map-0, piece-0-1)``, keeping that piece alone.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING

from raydag.core.records import MEMORY, WAITING

if TYPE_CHECKING:
    from raydag.core.state import State

Key = Hashable
Finder = Callable[[Iterable[Key], Mapping[Key, Iterable[Key]]], Mapping[Key, Iterable[Key]]]

_finders: list[Finder] = []


def register(finder: Finder) -> Finder:
    """Have ``find`` ask ``finder`` for the bundles of every graph (idempotent)."""
    if finder not in _finders:
        _finders.append(finder)
    return finder


def find(tasks: Iterable[Key], dependents: Mapping[Key, Iterable[Key]]) -> dict[Key, tuple]:
    """Every registered finder's bundles of a graph."""
    out: dict[Key, tuple] = {}
    keys = list(tasks)
    for finder in _finders:
        out.update({m: tuple(p) for m, p in finder(keys, dependents).items()})
    return out


class Bundler:
    """The state machine's bundles part: which maps run with their pieces."""

    def __init__(self, state: State, bundles: Mapping[Key, Iterable[Key]] | None) -> None:
        self.s = state
        self.pieces: dict[Key, tuple] = {}  # map -> its pieces
        self.map_of: dict[Key, Key] = {}  # piece -> its map
        tasks = state.tasks
        for m, pieces in (bundles or {}).items():
            pieces = tuple(pieces)
            tm = tasks.get(m)
            if (
                tm is None
                or tm.output
                or tm.given
                or not pieces
                or set(pieces) != tm.dependents
                or any(tasks[p].dependencies != {m} or tasks[p].given for p in pieces)
            ):
                continue  # runs as ordinary tasks
            self.pieces[m] = pieces
            self.map_of.update(dict.fromkeys(pieces, m))

    def member(self, key: Key) -> bool:
        """A map or a piece: it runs only as its bundle, never fused otherwise."""
        return key in self.pieces or key in self.map_of

    def group(self, key: Key) -> tuple[tuple, tuple] | None:
        """For a ready map: the keys of its group and the pieces it keeps (those still
        to be made: after a loss, the lost ones). ``None``: ``key`` is no map."""
        pieces = self.pieces.get(key)
        if pieces is None:
            return None
        wanted = tuple(p for p in pieces if self.s.tasks[p].state == WAITING)
        return (key, *wanted), wanted

    def validate(self) -> None:
        s = self.s
        for m, pieces in self.pieces.items():
            assert s.tasks[m].state != MEMORY, ("a bundle's map value left its task", m)
            assert all(self.map_of[p] == m for p in pieces)
        for g in s.groups.values():
            if g.keys[0] in self.pieces:
                assert g.returns == g.keys[1:], g
                assert set(g.returns) <= set(self.pieces[g.keys[0]]), g
            else:
                assert set(g.returns) <= set(g.consumers), g
                assert not any(self.member(k) for k in g.keys), g
