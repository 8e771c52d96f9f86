"""raydag: a Ray execution backend for dask graphs."""

from __future__ import annotations

from raydag import config as _config  # noqa: F401  (registers raydag.* defaults)
from raydag import shuffle as _shuffle  # noqa: F401  (registers its bundles)
from raydag.api import disable, enable, get, persist, ray_get
from raydag.core.events import WorkerDiedError
from raydag.core.graph import GraphError
from raydag.observe.record import last_run, performance_report
from raydag.runtime.cluster import connect

__all__ = [
    "GraphError",
    "WorkerDiedError",
    "connect",
    "disable",
    "enable",
    "get",
    "last_run",
    "performance_report",
    "persist",
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
