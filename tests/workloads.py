"""Graphs whose object-store footprint is known, for placement tests and benchmarks.

``chains``: the seed's pile-up. Each step of a chain reads the step before it, so
Ray's locality keeps the whole chain on the node that ran its first step (its CPU is
free again as soon as the step before ends); and every step's value is held until
the chain's ``norm`` (a summary of all of them, a fan-in of ``length`` inputs) lets
the ``write`` of each step run. Under locality alone the chain's values pile up on
one node while the others idle; ``length * nbytes`` is what a chain holds at its peak.
"""

from __future__ import annotations

import time

import dask
import numpy as np

MB = 2**20


def first(chain: int, nbytes: int, seconds: float, after: float = 0.0) -> np.ndarray:
    time.sleep(seconds)
    return np.full(nbytes // 8, float(chain))


def step(previous: np.ndarray, seconds: float) -> np.ndarray:
    time.sleep(seconds)
    return previous + 1.0


def stat(x: np.ndarray) -> float:
    return float(x[0])


def merge(*stats: float) -> float:
    return float(sum(stats))


def write(x: np.ndarray, norm: float, seconds: float) -> float:
    time.sleep(seconds)
    return float(x[0]) / norm


def total(*xs: float) -> float:
    return float(sum(xs))


def chains(
    n: int = 2,
    length: int = 60,
    nbytes: int = 2 * MB,
    seconds: float = 0.05,
    write_seconds: float = 0.01,
    sequential: bool = False,
) -> list:
    """``n`` chains of ``length`` steps of ``nbytes`` each; one float per chain.

    ``sequential``: each chain starts once the one before has ended, so the store
    holds one chain's values at a time.
    """
    out: list = []
    for c in range(n):
        after = out[-1] if sequential and out else 0.0
        x = dask.delayed(first)(c + 1, nbytes, seconds, after, dask_key_name=f"step-{c}-0")
        steps = [x]
        for i in range(1, length):
            x = dask.delayed(step)(x, seconds, dask_key_name=f"step-{c}-{i}")
            steps.append(x)
        stats = [dask.delayed(stat)(s, dask_key_name=f"stat-{c}-{i}") for i, s in enumerate(steps)]
        norm = dask.delayed(merge)(*stats, dask_key_name=f"norm-{c}")
        writes = [
            dask.delayed(write)(s, norm, write_seconds, dask_key_name=f"write-{c}-{i}")
            for i, s in enumerate(steps)
        ]
        out.append(dask.delayed(total)(*writes, dask_key_name=f"total-{c}"))
    return out


def chains_expected(n: int, length: int) -> list[float]:
    """What ``chains`` computes, without running it: step i of chain c holds c + 1 + i."""
    res = []
    for c in range(n):
        values = [c + 1.0 + i for i in range(length)]
        norm = sum(values)
        res.append(sum(v / norm for v in values))
    return res
