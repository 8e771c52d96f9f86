"""Storage-aware placement: no node's object store fills while others have room.

A node is *full* above ``high_water`` (a fraction of its store), and *crowded* when
full or, above half the high-water mark, fuller than the emptiest node by more than
``balance``. While no node is crowded, Ray's own locality decides (the node holding most
of a task's input bytes). Once one is, raydag places every task whose category makes
big values (``min_output``) itself: on that preferred node unless it is crowded, else on
the node with the most free store among those with a free CPU. While a node is full,
ready tasks that read intermediates go before tasks that read none, so the stores drain
before they fill.

Worked example (high-water 0.7, balance 0.1): stores n1 75 % used, n2 20 %, n3 30 %.
n1 is full, so crowded; n2 and n3 are below half the high-water mark (35 %), so not.
A task whose category makes big values and whose inputs sit mostly on n1 goes to the
node, among those not crowded with a free CPU, with the most free store: n2. Its inputs
and its expected output count against n2 until the next sample, so a run of such tasks
spreads over n2 and n3 instead of filling n2 first.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raydag import config

if TYPE_CHECKING:
    from raydag.core.records import Group
    from raydag.core.state import State

Key = Hashable


@dataclass(frozen=True)
class Placement:
    """Placement's settings (``raydag.placement.*``; defaults in raydag.yaml)."""

    enabled: bool = field(default_factory=lambda: config.default("placement.enabled"))
    high_water: float = field(default_factory=lambda: config.default("placement.high-water"))
    balance: float = field(default_factory=lambda: config.default("placement.balance"))
    # Only tasks whose category's values are this big on average are placed: moving a
    # task that makes little (a summary, a value Ray inlines) frees nothing where its
    # inputs are and copies them where it goes.
    min_output: int = field(default_factory=lambda: _bytes(config.default("placement.min-output")))

    def __post_init__(self) -> None:
        if not 0.0 < self.high_water <= 1.0:
            raise ValueError(
                f"raydag.placement.high-water must be in (0, 1], not {self.high_water!r}"
            )
        if not 0.0 <= self.balance <= 1.0:
            raise ValueError(f"raydag.placement.balance must be in [0, 1], not {self.balance!r}")

    @classmethod
    def from_config(cls) -> Placement:
        return cls(
            enabled=bool(config.get("placement.enabled")),
            high_water=float(config.get("placement.high-water")),
            balance=float(config.get("placement.balance")),
            min_output=_bytes(config.get("placement.min-output")),
        )


def _bytes(value: object) -> int:
    from dask.utils import parse_bytes

    return int(parse_bytes(value)) if isinstance(value, str) else int(value)  # type: ignore[arg-type]


class Placer:
    """The state machine's placement part: the stores' fill, and where a group goes."""

    def __init__(self, state: State, settings: Placement) -> None:
        self.s = state
        self.settings = settings
        self.any_full = False  # some store is above the high-water mark
        self.any_crowded = False

    def sampled(self, stores: dict, idle: dict) -> None:
        if not self.settings.enabled:
            return
        for n in self.s.nodes.values():
            n.store = None
        for node, store in stores.items():
            n = self.s.node(node)
            n.store = tuple(store)
            n.idle = float(idle.get(node, 0.0))
        self._crowding()

    def node_gone(self) -> None:
        """A node was taken for dead: its store no longer counts."""
        self._crowding()

    def _stored(self) -> list:
        return [n for n in self.s.nodes.values() if n.store is not None]

    def _crowding(self) -> None:
        p = self.settings
        stored = self._stored()
        filled = {n.id: n.store[0] / n.store[1] for n in stored if n.store[1]}
        low = min(filled.values(), default=0.0)
        for n in stored:
            f = filled.get(n.id)
            n.full = f is not None and f > p.high_water
            heavy = f is not None and f > p.high_water / 2 and f - low > p.balance
            n.crowded = n.full or heavy
        self.any_full = any(n.full for n in stored)
        self.any_crowded = any(n.crowded for n in stored)

    def place(self, group: Group) -> tuple[str | None, str]:
        """The node for a group's first copy, and why; ``None``: Ray's locality decides.

        Only while some store is crowded, and only groups whose category makes big
        values: then the node holding most of the group's input bytes, unless it is
        crowded too, else the node with the most free store among those not crowded
        with a free CPU (or else not crowded, or else not full; when every store is
        full, Ray decides: moving work would only add copies). What is placed counts
        against the node until the next sample: its CPUs, the inputs it fetches and
        the output its category usually makes.
        """
        if not self.settings.enabled or not self.any_crowded:
            return None, ""
        root = self.s.tasks[group.keys[-1]]
        cat = self.s.categories.get(root.category)
        if cat is None or not cat.made or cat.made_bytes / cat.made < self.settings.min_output:
            return None, ""
        if root.pinned:  # its options say where it runs (custom resources, a strategy)
            return None, ""
        r = root.resources or {}
        cpus = float(r.get("CPU", 1))
        stored = {n.id: n for n in self._stored()}
        held: dict[str, int] = {}
        for d in group.inputs:
            td = self.s.tasks[d]
            if td.node in stored:
                held[td.node] = held.get(td.node, 0) + (td.nbytes or 0)
        best = max(held, key=lambda n: (held[n], n)) if held else None
        if best is not None and not stored[best].crowded:
            node, why = best, "holds most input bytes"
        else:
            roomy = [n for n in stored.values() if not n.crowded]
            free = [n for n in roomy if n.idle >= cpus]
            some = free or roomy or [n for n in stored.values() if not n.full]
            if not some:  # every store is full: moving work would only add copies
                return None, ""
            node = max(some, key=lambda n: (n.store[1] - n.store[0], n.id)).id
            why = "most free store" + (f"; {best[:12]} is crowded" if best else "")
        n = stored[node]
        n.idle -= cpus
        used, cap = n.store
        used += sum(b for m, b in held.items() if m != node) + cat.made_bytes // cat.made
        n.store = (used, cap)
        self._crowding()
        return node, why

    def validate(self) -> None:
        stored = self._stored()
        assert all(n.crowded or not n.full for n in stored)
        assert self.any_full == any(n.full for n in stored)
        assert all(not n.full and not n.crowded for n in self.s.nodes.values() if n.store is None)
