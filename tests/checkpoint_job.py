"""A compute for the checkpoint tests, run in-process or as a driver of its own
(``python -c "import checkpoint_job; checkpoint_job.main()" STORE LOG OUT``), which a test
kills with SIGKILL and runs again.

Each task appends its key and the time it ended to a log file (one line, ``O_APPEND``),
so a test counts the tasks each run ran, and a benchmark which had ended by a kill.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def step(log: str, seconds: float, label: str, *inputs: np.ndarray) -> np.ndarray:
    """Sleep, log ``label`` (its key, ``#``-prefixed: not a key itself) and the time,
    make an array."""
    key = label.lstrip("#")
    time.sleep(seconds)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{key} {time.time():.3f}\n".encode())
    finally:
        os.close(fd)
    base = np.arange(20_000, dtype="f8") + len(key)
    return base + sum(float(np.sum(x)) % 97 for x in inputs) if inputs else base


def graph(log: str, n: int = 8, seconds: float = 0.5, hold: str | None = None) -> dict:
    """``n`` loads, a process of each, pairs summed, a total; with ``hold``, the total
    also waits for the file ``hold`` to exist (a test kills the driver meanwhile)."""
    dsk: dict = {}
    for i in range(n):
        dsk[f"load-{i}"] = (step, log, seconds, f"#load-{i}")
        dsk[f"proc-{i}"] = (step, log, seconds, f"#proc-{i}", f"load-{i}")
    for i in range(0, n, 2):
        dsk[f"pair-{i}"] = (
            step,
            log,
            seconds_of("pair", seconds),
            f"#pair-{i}",
            f"proc-{i}",
            f"proc-{i + 1}",
        )
    dsk["total"] = (
        step,
        log,
        seconds_of("total", seconds),
        "#total",
        *(f"pair-{i}" for i in range(0, n, 2)),
    )
    if hold is not None:
        dsk["hold"] = (gate, hold)
        dsk["total"] += ("hold",)
    return dsk


def gate(path: str, timeout: float = 120.0) -> float:
    """Wait until ``path`` exists (a test opens the gate); 0.0."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gate {path} was never opened")
        time.sleep(0.05)
    return 0.0


def ran(log: str) -> list[str]:
    """The keys of the tasks that ran, in the order they ended."""
    return [k for k, _ in ended(log)]


def ended(log: str) -> list[tuple[str, float]]:
    """Each task run: its key and when it ended (``time.time()``)."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [(k, float(t)) for k, t in (line.split() for line in f if line.strip())]


def seconds_of(key: str, seconds: float) -> float:
    """A task's own seconds in ``graph``: loads and processings ``seconds``, the rest 0.05."""
    return seconds if key.startswith(("load-", "proc-")) else 0.05


def main() -> None:
    """``STORE LOG OUT [MIN_COST|off [N [SECONDS [HOLD]]]]``: compute ``graph``'s total
    into OUT (``.npy``), with checkpoints in STORE written from MIN_COST (default 0 s);
    the total waits for the file HOLD, if given."""
    import dask

    import raydag

    store, log, out, *rest = sys.argv[1:]
    min_cost = rest[0] if rest else "0s"
    n = int(rest[1]) if len(rest) > 1 else 8
    seconds = float(rest[2]) if len(rest) > 2 else 0.5
    hold = rest[3] if len(rest) > 3 else None
    conf = {"raydag.checkpoint.store": store, "raydag.checkpoint.min-cost": min_cost}
    if min_cost == "off":
        conf = {"raydag.checkpoint.enabled": False}
    raydag.connect()
    t0 = time.perf_counter()
    with dask.config.set(conf):
        total = raydag.get(graph(log, n, seconds, hold), "total")
    np.save(out, total)
    with open(f"{out}.seconds", "w") as f:  # the compute's own time, for bench/checkpoint.py
        f.write(str(time.perf_counter() - t0))


if __name__ == "__main__":
    main()
