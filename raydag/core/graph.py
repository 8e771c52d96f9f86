"""The task graph as raydag holds it: dask's input normalised once, checked before anything runs.

Whatever dask hands a scheduler's ``get`` (a ``HighLevelGraph``, a plain dict, an
expression, legacy tuple tasks or ``dask._task_spec`` nodes) becomes one ``Graph``:
task nodes, dependencies both ways, the requested keys, ``dask.order`` priorities and
per-key annotations. The graph is raydag's lineage: every result can be recomputed
from it.
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dask.core import flatten
from dask.order import order

from raydag.compat import DataNode, GraphNode, convert_legacy_graph

Key = Hashable


class GraphError(ValueError):
    """The graph cannot run: raised before anything is submitted."""


class UnknownAnnotationWarning(UserWarning):
    """A task carries an annotation that neither raydag nor dask's schedulers read."""


# Annotations raydag acts on (``dask.annotate(resources=..., retries=...)``, and Ray's
# Dask-on-Ray ``ray_remote_args``: ``raydag.core.options``), and those
# dask and distributed set or document that mean nothing on Ray: where and in which
# order tasks run is raydag's to decide (docs/semantics.md). dask-awkward marks its
# writers' layers ``ak_output`` for its own graph optimisation, done before any get.
HANDLED_ANNOTATIONS = frozenset({"resources", "retries", "checkpoint", "ray_remote_args"})
FOREIGN_ANNOTATIONS = frozenset(
    {
        "priority",
        "workers",
        "allow_other_workers",
        "executor",
        "span",
        "shuffle_original_restrictions",
        "ak_output",
    }
)


@dataclass
class Graph:
    tasks: dict[Key, GraphNode]
    dependencies: dict[Key, frozenset]
    dependents: dict[Key, set]
    outputs: set
    priorities: dict[Key, int]
    annotations: dict[str, dict[Key, Any]] = field(default_factory=dict)
    # Keys whose values already exist outside this graph (ObjectRefs, or ``Persisted``
    # results of an earlier ``raydag.persist``): not run unless lost, never owned here.
    external: dict[Key, Any] = field(default_factory=dict)
    # Those external keys whose producing tasks are in ``tasks``, so they can be
    # recomputed if their values are lost.
    lineage: set = field(default_factory=set)
    # ``priorities`` are ``dask.order``'s; False: a provisional depth-first order, and
    # ``order()`` gives dask.order's (computed while the compute runs: ``Ordered``)
    ordered: bool = True

    def __len__(self) -> int:
        return len(self.tasks)

    def annotation(self, name: str, key: Key, default: Any = None) -> Any:
        return self.annotations.get(name, {}).get(key, default)

    def order(self) -> dict[Key, int]:
        """``dask.order``'s priorities, of each connected part of the graph alone, the
        parts one after another in the order the provisional order began them.

        Ordered while the compute runs, ``dask.order``'s working structures (a set or
        two per key: 150 MB at 330k keys) come on top of the driver's: one part at a
        time, they are a part's. Parts share no task: finishing one before starting the
        next holds no more than interleaving them would (the values a part keeps are
        its outputs), and the part under way goes on first. A graph of one part gets
        dask.order's order of the whole graph, exactly.
        """
        tasks, dependencies = self.tasks, self.dependencies
        priorities: dict[Key, int] = {}
        for part in _parts(dependencies, self.dependents, self.priorities):
            if len(part) == len(tasks):
                return _order(tasks, dependencies)
            ranks = _order({k: tasks[k] for k in part}, {k: dependencies[k] for k in part})
            for k in sorted(ranks, key=ranks.__getitem__):
                priorities[k] = len(priorities)
        return priorities

    def unknown_annotations(self) -> list[str]:
        """Annotation names no scheduler is known to read (a typo: ``retires=2``)."""
        known = HANDLED_ANNOTATIONS | FOREIGN_ANNOTATIONS
        return sorted(str(name) for name in self.annotations if name not in known)

    @classmethod
    def from_dask(
        cls,
        dsk: Any,
        keys: Any,
        is_external: Callable[[Any], bool] = lambda value: False,
        find_external: Callable[[Key], Any] = lambda key: None,
        around: Mapping[str, Any] | None = None,
        order_later_above: int | None = None,
    ) -> Graph:
        """``is_external`` tells given values (ObjectRefs) among the graph's data;
        ``find_external`` finds a given value for a key the graph only refers to (a
        persisted result, referenced as a ``TaskRef`` the way distributed's futures are).
        A given value with a ``lineage`` mapping brings the tasks that made it.
        ``around``: the annotations active around the compute (``dask.get_annotations()``
        in the get), for every task whose layer does not give that name itself.
        ``order_later_above``: a graph of more tasks gets a provisional depth-first order
        (``depth_first``), and ``dask.order``'s is left to ``order()``.
        """
        annotations = _annotations(dsk)
        if not isinstance(dsk, Mapping):
            dsk = dsk.__dask_graph__()
        tasks = _keyed(convert_legacy_graph(dsk))
        external = {
            k: t.value for k, t in tasks.items() if isinstance(t, DataNode) and is_external(t.value)
        }
        lineage: set = set()
        producers: dict[Key, GraphNode] = {}

        @functools.cache
        def resolve(key: Key) -> GraphNode | None:
            value = find_external(key)
            if value is None:
                return producers.get(key)  # an ancestor of a given value
            external[key] = value
            made_by = getattr(value, "lineage", None) or {}
            if key not in made_by:
                return DataNode(key, value)
            lineage.add(key)
            producers.update(made_by)
            return made_by[key]

        requested = list(flatten(keys)) if isinstance(keys, list) else [keys]  # as given
        outputs = set(requested)
        tasks = _cull(tasks, outputs, resolve)
        # each node's own frozenset, not a copy: at 330k keys a copy is 80 MB
        dependencies = {k: _frozen(t.dependencies) for k, t in tasks.items()}
        dependents: dict[Key, set] = {k: set() for k in tasks}
        for k, deps in dependencies.items():
            for d in deps:
                dependents[d].add(k)
        _check_acyclic(dependencies, dependents)
        external = {k: v for k, v in external.items() if k in tasks}
        lineage &= set(external)
        annotations = {
            name: {k: v for k, v in values.items() if k in tasks}
            for name, values in annotations.items()
        }
        for name, value in (around or {}).items():
            per_key = annotations.setdefault(name, {})
            for k in tasks:
                if k not in per_key:
                    per_key[k] = value(k) if callable(value) else value
        later = order_later_above is not None and len(tasks) > order_later_above
        return cls(
            tasks=tasks,
            dependencies=dependencies,
            dependents=dependents,
            outputs=outputs,
            priorities=depth_first(dependencies, requested)
            if later
            else _order(tasks, dependencies),
            ordered=not later,
            annotations={name: v for name, v in annotations.items() if v},
            external=external,
            lineage=lineage,
        )


def depth_first(
    dependencies: Mapping[Key, Iterable[Key]], outputs: Iterable[Key]
) -> dict[Key, int]:
    """A provisional order, linear in the graph: each output's inputs depth-first, every
    task right after its inputs (a post-order walk from the outputs, in the graph's
    order of outputs and of inputs).

    It starts a compute in a twentieth of ``dask.order``'s time (0.08 s against 1.55 s of
    CPU at 60k keys) and is the classic memory-frugal order on the shapes that matter most: a
    fan-in's inputs are made one subtree at a time and the fan-in runs as soon as the
    last is made, so the values in memory are one path's side inputs, not a level of
    the graph. Worked example: outputs ``s0 = sum(c0, c1)`` and ``s1 = sum(c2, c3)``,
    each ``c`` a chain ``r -> p -> c``: ``r0 p0 c0 r1 p1 c1 s0``, then ``s1``'s; at most
    two chain ends and one chain's value are held. What it does not do that dask.order
    does: weigh the inputs of a task against each other (the cheaper subtree first),
    or start a root shared by many tasks early. Keys the outputs do not need come last.
    """
    priorities: dict[Key, int] = {}
    done = priorities.__contains__
    for out in (*outputs, *dependencies):
        if done(out):
            continue
        stack = [(out, iter(dependencies[out]))]
        while stack:
            key, todo = stack[-1]
            for d in todo:
                if not done(d) and d in dependencies:
                    stack.append((d, iter(dependencies[d])))
                    break
            else:
                stack.pop()
                if not done(key):
                    priorities[key] = len(priorities)
    return priorities


def _parts(
    dependencies: Mapping[Key, Iterable[Key]],
    dependents: Mapping[Key, Iterable[Key]],
    priorities: Mapping[Key, int],
) -> list[list[Key]]:
    """The graph's connected parts (tasks linked by any path of edges, either way),
    each listed from its first key by ``priorities``, in the order of those keys."""
    seen: set = set()
    parts = []
    for start in sorted(priorities, key=priorities.__getitem__):
        if start in seen:
            continue
        seen.add(start)
        part, todo = [], [start]
        while todo:
            k = todo.pop()
            part.append(k)
            for n in (*dependencies[k], *dependents[k]):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        parts.append(part)
    return parts


def _frozen(deps: Iterable[Key]) -> frozenset:
    return deps if type(deps) is frozenset else frozenset(deps)


def _order(tasks: dict[Key, GraphNode], dependencies: dict[Key, frozenset]) -> dict[Key, int]:
    """``dask.order``'s priorities, and its working structures freed at once.

    ``dask.order`` works in closures that refer to one another, so its dicts and sets
    (a set per key among them: 190 MB at 330k keys) outlive it as cyclic garbage until
    the collector's next full pass, which may come long after, once the driver has
    grown around them. The objects made before it are frozen (set aside from the
    collector), so one collection walks only what ``order`` made, not the graph.
    """
    gc.freeze()
    try:
        return order(tasks, dependencies=dict(dependencies))
    finally:
        gc.collect()
        gc.unfreeze()


def _cull(
    tasks: dict[Key, GraphNode],
    outputs: Iterable[Key],
    resolve: Callable[[Key], GraphNode | None],
) -> dict[Key, GraphNode]:
    """Keep what the outputs need; name the first key that is needed but absent."""
    culled: dict[Key, GraphNode] = {}
    stack = []
    for k in outputs:
        node = tasks[k] if k in tasks else resolve(k)
        if node is None:
            raise GraphError(f"Requested key {k!r} is not in the graph")
        stack.append((k, node))
    while stack:
        k, node = stack.pop()
        if k in culled:
            continue
        culled[k] = node
        for d in node.dependencies:
            if d in culled:
                continue
            dep = tasks[d] if d in tasks else resolve(d)
            if dep is None:
                raise GraphError(f"Task {k!r} depends on {d!r}, which is not in the graph")
            stack.append((d, dep))
    return culled


def _keyed(tasks: dict[Key, GraphNode]) -> dict[Key, GraphNode]:
    """Each node under its graph's key: the key it is stored under is its name, as in
    dask's own schedulers, whatever the node says (``dd.from_delayed(...,
    verify_meta=False)`` stores an ``Alias`` named after its target's container under
    the partition's key). A node that disagrees is copied with the graph's key."""
    for k, t in tasks.items():
        if t.key != k:
            t = copy.copy(t)
            t.key = k
            tasks[k] = t
    return tasks


def _check_acyclic(dependencies: Mapping[Key, frozenset], dependents: Mapping[Key, set]) -> None:
    missing = {k: len(d) for k, d in dependencies.items()}
    stack = [k for k, n in missing.items() if n == 0]
    seen = 0
    while stack:
        k = stack.pop()
        seen += 1
        for d in dependents[k]:
            missing[d] -= 1
            if missing[d] == 0:
                stack.append(d)
    if seen == len(dependencies):
        return
    # Walk dependencies among the unfinished keys until one repeats: that is a cycle.
    key = next(k for k, n in missing.items() if n > 0)
    path: list[Key] = []
    on_path: dict[Key, int] = {}
    while key not in on_path:
        on_path[key] = len(path)
        path.append(key)
        key = next(d for d in dependencies[key] if missing[d] > 0)
    cycle = path[on_path[key] :] + [key]
    raise GraphError("Cycle in the graph: " + " -> ".join(map(repr, cycle)))


def _annotations(dsk: Any) -> dict[str, dict[Key, Any]]:
    """Per-key annotations from an expression, a HighLevelGraph, or nothing."""
    if hasattr(dsk, "__dask_annotations__"):
        try:
            return dict(dsk.__dask_annotations__())
        except TypeError:  # collections define it as a plain attribute on some versions
            pass
    result: dict[str, dict[Key, Any]] = {}
    for layer in getattr(dsk, "layers", {}).values():
        for name, value in (getattr(layer, "annotations", None) or {}).items():
            result.setdefault(name, {}).update(
                {k: value(k) if callable(value) else value for k in layer}
            )
    return result
