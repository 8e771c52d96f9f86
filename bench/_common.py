"""What every benchmark prints first: the machine, the versions, raydag's settings."""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any


def machine() -> dict[str, Any]:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "ram_bytes": ram,
        "platform": platform.platform(),
        "loadavg": load,
    }


def proc_status(field: str) -> int:
    """A byte count of this process's ``/proc/self/status`` (``VmRSS``, ``VmHWM``); 0
    where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def versions() -> dict[str, str]:
    import dask
    import numpy
    import ray

    import raydag

    return {
        "python": platform.python_version(),
        "ray": ray.__version__,
        "dask": dask.__version__,
        "numpy": numpy.__version__,
        "raydag": raydag.__version__,
    }


def ray_settings() -> dict[str, Any]:
    """The embedded Ray's size and the raydag settings that shape a run."""
    import ray

    from raydag import config

    res = ray.cluster_resources()
    return {
        "cluster_cpus": res.get("CPU"),
        "object_store_bytes": res.get("object_store_memory"),
        "free_objects_period": config.get("local-ray.free-objects-period"),
        "in_flight_per_cpu": config.get("scheduling.in-flight-per-cpu"),
        "fusion": config.get("fusion.enabled"),
        "fusion_max_task": config.get("fusion.max-task-duration"),
    }


def print_header(title: str, extra: Mapping[str, Any] = ()) -> dict[str, Any]:
    m, v = machine(), versions()
    print(f"== {title} ==")
    ram = f"{m['ram_bytes'] / 2**30:.1f} GiB" if m["ram_bytes"] else "unknown"
    load = ", ".join(f"{x:.2f}" for x in m["loadavg"]) if m["loadavg"] else "n/a"
    print(f"machine : {m['cpus']} CPUs, {m['cpu_model']}, {ram} RAM, load avg {load}")
    print(f"          {m['platform']}")
    print("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    for k, val in dict(extra).items():
        print(f"{k:8}: {val}")
    return {"machine": m, "versions": v, **dict(extra)}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c: Any) -> str:
    if c is None:
        return "-"
    if isinstance(c, float):
        return f"{c:,.3f}" if abs(c) < 10 else f"{c:,.1f}" if abs(c) < 1000 else f"{c:,.0f}"
    return str(c)


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
    print(f"wrote {path}", file=sys.stderr)


def start_ray(start: Any = None, attempts: int = 8) -> None:
    """``start()`` (``raydag.connect`` by default), again if a raylet times out starting:
    on a loaded machine Ray's 30 s deadline for a new node is sometimes missed."""
    import ray

    import raydag

    for attempt in range(attempts):
        try:
            (start or raydag.connect)()
            return
        except Exception:
            ray.shutdown()
            if attempt == attempts - 1:
                raise
            time.sleep(5.0)
