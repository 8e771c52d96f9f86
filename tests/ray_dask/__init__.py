"""Ray's tests of ``ray.util.dask``, on ``ray_dask_get`` and with raydag standing in.

A package, so that Ray's workers (whose ``PYTHONPATH`` holds ``tests/``) import these
test modules by the name the driver gave them. Importing it makes ``ray.tests.conftest``
(which the ray wheel does not ship) this folder's fixtures, in the driver and in the
workers: Ray's test files start with ``from ray.tests.conftest import *``.
"""

import importlib.util
import sys
import types

from . import ray_fixtures

if "ray.tests.conftest" not in sys.modules:
    if importlib.util.find_spec("ray.tests") is None:
        sys.modules["ray.tests"] = types.ModuleType("ray.tests")
    sys.modules["ray.tests.conftest"] = ray_fixtures
