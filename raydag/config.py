"""raydag's settings live in dask.config under ``raydag.*``; their defaults in raydag.yaml only.

``get`` and ``seconds`` read the setting in force (what the user set, else the default);
``default`` reads the YAML's own value, for the policies' dataclass defaults, so that a
setting has one default, written once, with its reason beside it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import dask.config
import dask.utils
import yaml

_fn = os.path.join(os.path.dirname(__file__), "raydag.yaml")
with open(_fn) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def get(key: str, default: Any = None) -> Any:
    return dask.config.get(f"raydag.{key}", default=default)


def seconds(key: str) -> float:
    return _seconds(get(key))


def optional_seconds(key: str) -> float | None:
    """A duration that may be ``null`` (off)."""
    value = get(key)
    return None if value is None else _seconds(value)


def default(key: str) -> Any:
    """The default of ``raydag.<key>`` as raydag.yaml gives it."""
    return _default(key)


def default_seconds(key: str) -> float | None:
    value = _default(key)
    return None if value is None else _seconds(value)


@functools.cache
def _default(key: str) -> Any:
    return dask.config.get(key, config=defaults["raydag"])


def _seconds(value: Any) -> float:
    return float(dask.utils.parse_timedelta(value, default="s"))
