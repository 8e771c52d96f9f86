"""raydag: run dask graphs on Ray, keeping only what is still needed."""

from __future__ import annotations

from raydag import config as _config  # noqa: F401  (registers raydag.* defaults)
from raydag.api import get, persist, ray_get
from raydag.graph import GraphError

__all__ = ["GraphError", "get", "persist", "ray_get"]
__version__ = "0.1.0"
