"""raydag: run dask graphs on Ray, keeping only what is still needed."""

from __future__ import annotations

from raydag import config as _config  # noqa: F401  (registers raydag.* defaults)
from raydag.api import get, persist, ray_get
from raydag.graph import GraphError
from raydag.record import last_run
from raydag.report import performance_report
from raydag.state import WorkerDiedError

__all__ = [
    "GraphError",
    "WorkerDiedError",
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
