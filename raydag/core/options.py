"""Ray task options per task: raydag's ``dask.annotate(resources=...)`` and Ray's
Dask-on-Ray ``ray_remote_args`` (the compute's keyword, and
``dask.annotate(ray_remote_args=...)``), as two facts per task for the state machine.

- ``resources``: what it counts and compares (a group's slots, fusion's "same kind",
  where placement and duplicates may go), in raydag's spelling: ``CPU``, ``GPU``,
  ``memory`` and custom resources. ``ray_remote_args``' ``num_cpus``, ``num_gpus``,
  ``memory`` and ``resources`` land here, over the ``resources`` annotation's.
- ``remote_args``: every other Ray task option (``scheduling_strategy``,
  ``runtime_env``, ``max_retries``, ``accelerator_type``, ...), passed through to
  ``.options()`` as given. Equal dicts are one object, so the Ray layer caches one
  remote function per distinct set of options.

A task is ``pinned`` when its options say where it runs (a custom resource, a
``scheduling_strategy``): raydag's placement and speculative duplicates leave it alone.

Precedence is Ray's (``ray.util.dask.scheduler``): per key, the keyword's dict
``.update()``-d with the key's annotation (top level: an annotation's ``resources``
replaces the keyword's whole ``resources``). Annotations active around the compute
apply to every key whose layer does not annotate that name itself (``Graph.from_dask``).

Worked example: keyword ``{"num_cpus": 2, "max_retries": 1}``; key ``a`` annotated
``{"resources": {"pin": 0.01}, "scheduling_strategy": "SPREAD"}``, key ``b`` not::

    a: resources {"CPU": 2, "pin": 0.01},
       remote_args {"max_retries": 1, "scheduling_strategy": "SPREAD"}, pinned
    b: resources {"CPU": 2}, remote_args {"max_retries": 1}
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Key = Hashable

# Ray's option -> raydag's resource name.
RESOURCE_OPTIONS = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
# Options raydag sets itself, for every Ray task it submits.
RAYDAG_OPTIONS = {
    "num_returns": "raydag sets num_returns itself (one value per kept key, and an outcome)",
}
PLAIN_RESOURCES = frozenset({"CPU", "GPU", "memory"})


class OptionsError(ValueError):
    """``ray_remote_args`` that cannot be Ray task options: raised before anything runs."""


@dataclass
class TaskOptions:
    """Each task's resources, other Ray options and pinning (only tasks that have any)."""

    resources: dict[Key, dict] = field(default_factory=dict)
    remote_args: dict[Key, dict] = field(default_factory=dict)
    pinned: set = field(default_factory=set)


def task_options(
    keys: Iterable[Key],
    annotations: Mapping[str, Mapping[Key, Any]],
    keyword: Mapping[str, Any] | None = None,
    validate: Callable[[dict], None] = lambda options: None,
) -> TaskOptions:
    """The options of every key in ``keys``.

    ``annotations``: per name, per key (``Graph.annotations``); ``keyword``: the
    compute's ``ray_remote_args``; ``validate``: checks one merged dict of Ray options
    (the Ray layer's: Ray's own validation), called once per distinct dict.
    """
    if keyword is not None and not isinstance(keyword, Mapping):
        raise TypeError(
            "ray_remote_args must be a dict of Ray task options (the keywords of "
            f"a remote function's .options()), not {type(keyword).__name__}: {keyword!r}"
        )
    keyword = dict(keyword or {})
    given = annotations.get("ray_remote_args", {})
    declared = annotations.get("resources", {})
    out = TaskOptions()
    seen: list[tuple[Any, Any, dict, dict]] = []  # (annotation, resources) -> split
    for k in keys:
        annotation = given.get(k)
        resources = declared.get(k)
        if annotation is None and not keyword and not resources:
            continue
        split = _lookup(seen, annotation, resources)
        if split is None:
            split = _split(k, keyword, annotation, resources, validate)
            split = _intern(seen, annotation, resources, *split)
        res, rest = split
        if res:
            out.resources[k] = res
            if set(res) - PLAIN_RESOURCES:
                out.pinned.add(k)
        if rest:
            out.remote_args[k] = rest
            if "scheduling_strategy" in rest:
                out.pinned.add(k)
    return out


def _lookup(seen: list, annotation: Any, resources: Any) -> tuple[dict, dict] | None:
    for a, r, res, rest in seen:
        if (a is annotation or a == annotation) and (r is resources or r == resources):
            return res, rest
    return None


def _intern(seen: list, annotation: Any, resources: Any, res: dict, rest: dict) -> tuple:
    """Equal results are one object (the Ray layer caches by identity)."""
    for _, _, res2, rest2 in seen:
        if res2 == res:
            res = res2
        if rest2 == rest:
            rest = rest2
    seen.append((annotation, resources, res, rest))
    return res, rest


def _split(
    key: Key,
    keyword: dict,
    annotation: Any,
    resources: Any,
    validate: Callable[[dict], None],
) -> tuple[dict, dict]:
    if annotation is not None and not isinstance(annotation, Mapping):
        raise TypeError(
            f"dask.annotate(ray_remote_args=...) of {key!r} must be a dict of Ray task "
            f"options, not {type(annotation).__name__}: {annotation!r}"
        )
    if resources is not None and not isinstance(resources, Mapping):
        raise TypeError(
            f"dask.annotate(resources=...) of {key!r} must be a dict of resource "
            f"amounts, not {type(resources).__name__}: {resources!r}"
        )
    merged = dict(keyword)
    merged.update(annotation or {})
    for name, why in RAYDAG_OPTIONS.items():
        if name in merged:
            raise OptionsError(f"ray_remote_args of {key!r} may not set {name!r}: {why}")
    if merged:
        try:
            validate(merged)
        except (TypeError, ValueError) as e:
            raise OptionsError(f"ray_remote_args of {key!r} ({merged!r}): {e}") from e
    res = dict(resources or {})
    rest = {}
    for name, value in merged.items():
        if name in RESOURCE_OPTIONS:
            if value is not None:
                res[RESOURCE_OPTIONS[name]] = value
        elif name == "resources":
            if value is not None and not isinstance(value, Mapping):
                raise OptionsError(
                    f"ray_remote_args of {key!r}: 'resources' must be a dict of custom "
                    f"resource amounts, not {type(value).__name__}"
                )
            res.update(value or {})
        else:
            rest[name] = value
    return res, rest
