"""``pip install .`` with no extras gives a raydag whose run record and report work.

Run as a script by ``nox -s plain`` (a fresh venv with raydag's own dependencies and
nothing else) and ``nox -s floor`` (the lowest supported versions). Not a pytest
module: pytest collects ``test_*.py`` only.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import sys
import tempfile

import dask

import raydag
from raydag.runtime import stores


def inc(x: int) -> int:
    return x + 1


def main() -> None:
    versions = {d: importlib.metadata.version(d) for d in ("raydag", "ray", "dask", "pandas")}
    print("python", sys.version.split()[0], versions, "raydag", raydag.__version__)
    assert raydag.__version__ == versions["raydag"], raydag.__version__
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.html"
        with dask.config.set({"raydag.local-ray.num-cpus": 2}), raydag.performance_report(report):
            assert raydag.get({"a": 1, "b": (inc, "a"), "c": (inc, "b")}, "c") == 3
            (total,) = dask.compute(
                dask.delayed(sum)([dask.delayed(inc)(i) for i in range(20)]), scheduler=raydag.get
            )
            assert total == sum(range(1, 21)), total
        events = raydag.last_run().events  # a pandas frame: pandas must be installed
        assert len(events) and {"event", "key", "time"} <= set(events.columns), events.columns
        assert report.is_file(), "performance_report wrote no file"
        size = report.stat().st_size
        assert size > 100_000, f"the report is only {size} bytes"
        assert stores.store_stats(), "no store stats: the raylets' gRPC stubs do not work"
    print(f"plain install: compute, {len(events)} events, a {size // 1024} KiB report: ok")


if __name__ == "__main__":
    main()
