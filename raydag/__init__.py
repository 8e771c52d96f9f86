"""raydag: a Ray execution backend for dask graphs."""

from __future__ import annotations

from raydag import config as _config  # noqa: F401  (registers raydag.* defaults)
from raydag import shuffle as _shuffle  # noqa: F401  (registers its bundles)
from raydag.api import (
    disable,
    disable_dask_on_ray,
    enable,
    enable_dask_on_ray,
    get,
    persist,
    ray_dask_get,
    ray_dask_get_sync,
    ray_dask_persist,
    ray_get,
)
from raydag.core.events import WorkerDiedError
from raydag.core.graph import GraphError
from raydag.observe.record import last_run, performance_report
from raydag.runtime.cluster import connect

__all__ = [
    "GraphError",
    "WorkerDiedError",
    "connect",
    "disable",
    "disable_dask_on_ray",
    "enable",
    "enable_dask_on_ray",
    "get",
    "last_run",
    "performance_report",
    "persist",
    "ray_dask_get",
    "ray_dask_get_sync",
    "ray_dask_persist",
    "ray_get",
]


def _version() -> str:
    """The installed distribution's version (one string: pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raydag")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__ = _version()
