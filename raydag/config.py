"""raydag's settings live in dask.config under ``raydag.*``, defaults from raydag.yaml."""

from __future__ import annotations

import os
from typing import Any

import dask.config
import yaml

_fn = os.path.join(os.path.dirname(__file__), "raydag.yaml")
with open(_fn) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str, default: Any = None) -> Any:
    return dask.config.get(f"raydag.{key}", default=default)


def seconds(key: str) -> float:
    value = get(key)
    return float(dask.utils.parse_timedelta(value, default="s"))
