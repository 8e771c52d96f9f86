"""A live progress display for one compute, in the terminal or in Jupyter.

An observer of the state machine's transcript: it counts tasks as their results
really come back (not as they are submitted), and shows what runs, what failed,
what is being recomputed after a loss, and how full the object stores are (from
the store sampler's rounds). It draws with ``tqdm.auto``: a text bar in a
terminal, a widget in Jupyter. It redraws at most every ``raydag.progress.interval``,
so a fast stream of tiny tasks costs a counter increment each.

``raydag.progress.enabled``: ``auto`` (the default) shows it when stderr is a
terminal or in a Jupyter kernel, so scripts, logs and CI stay quiet.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from raydag import config
from raydag.core.events import Event, Instruction, Recover, TaskErred, TaskFinished
from raydag.core.records import PROCESSING, READY, WAITING
from raydag.core.state import State

logger = logging.getLogger(__name__)


def wanted() -> bool:
    """Whether to show progress for this compute, from ``raydag.progress.enabled``."""
    value = config.get("progress.enabled", "auto")
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return interactive()
        return v in ("1", "true", "yes", "on")
    return bool(value)


def interactive() -> bool:
    """In a Jupyter kernel, or with stderr attached to a terminal."""
    if "ipykernel" in sys.modules:
        try:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
                return True
        except Exception:
            pass
    try:
        return sys.stderr.isatty()
    except Exception:  # a replaced stderr without isatty
        return False


def _dask_bar_active(callbacks: Sequence[Any]) -> bool:
    """Whether one of dask's callbacks is a ``ProgressBar`` (it draws on the same line)."""
    from dask.diagnostics import ProgressBar

    for cb in callbacks or ():
        for f in cb:
            if isinstance(getattr(f, "__self__", None), ProgressBar):
                return True
    return False


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class Progress:
    """``observe(event, instructions)``: a tqdm bar over the compute's tasks."""

    def __init__(
        self,
        state: State,
        *,
        interval: float = 0.2,
        file: IO[str] | None = None,
        position: int | None = None,
        desc: str = "raydag",
    ) -> None:
        self.state = state
        self.interval = interval
        self.done = 0
        self.failed = 0
        self.recomputed = 0
        self.recovering: set = set()  # keys of recovery waves not finished since
        self.store_used: int | None = None
        self.store_capacity: int | None = None
        self._last = 0.0
        self._bar: Any = None
        self._bar_args = {"file": file, "position": position, "desc": desc}

    def __call__(self, event: Event | None, instructions: Sequence[Instruction]) -> None:
        cls = type(event)
        if cls is TaskFinished:
            self.done += len(event.durations)
            if self.recovering:
                self.recovering.difference_update(event.durations)
        elif event is None:
            self._open()
        else:
            if cls is TaskErred and not event.node_died:  # a lost node is no task's failure
                self.failed += 1
            for ins in instructions:
                if type(ins) is Recover:
                    self.recomputed += len(ins.recompute)
                    self.recovering.update(ins.recompute)
                    if self._bar is not None:
                        self._bar.total += len(ins.recompute)
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self.refresh()

    def stores(self, t: float, stats: Mapping[str, Any]) -> None:
        """A store sampler's round (called from its thread): remember the totals."""
        self.store_used = sum(s.used_bytes for s in stats.values())
        self.store_capacity = sum(s.capacity_bytes for s in stats.values())

    def _open(self) -> None:
        todo = sum(
            1 for ts in self.state.tasks.values() if ts.state in (WAITING, READY, PROCESSING)
        )
        args = {k: v for k, v in self._bar_args.items() if v is not None}
        args.update(total=todo, unit="task", dynamic_ncols=True, leave=True)
        try:
            from tqdm.auto import tqdm

            self._bar = tqdm(**args)
        except Exception:  # e.g. Jupyter without ipywidgets: text instead of a widget
            from tqdm.std import tqdm as text_tqdm

            try:
                self._bar = text_tqdm(**args)
            except Exception:
                logger.warning("raydag: no progress display", exc_info=True)

    def postfix(self) -> str:
        st = self.state
        running = sum(len(g.keys) for g in st.groups.values())
        parts = [f"running {running}"]
        if self.failed:
            parts.append(f"failed {self.failed}")
        if self.recovering:
            parts.append(f"recovering {len(self.recovering)}")
        if self.store_used is not None:
            parts.append(f"stores {_bytes(self.store_used)}/{_bytes(self.store_capacity or 0)}")
        return ", ".join(parts)

    def refresh(self) -> None:
        bar = self._bar
        if bar is None:
            return
        try:
            bar.n = self.done
            bar.set_postfix_str(self.postfix(), refresh=False)
            bar.refresh()
        except Exception:  # a display must never stop a compute (a closed stream, say)
            logger.warning("raydag: progress display stopped", exc_info=True)
            self._bar = None

    def close(self, error: BaseException | None = None) -> None:
        bar = self._bar
        if bar is None:
            return
        self.refresh()
        if error is not None:
            bar.set_description_str(f"{bar.desc} ({type(error).__name__})", refresh=True)
        bar.close()
        self._bar = None


def start(state: State, callbacks: Sequence[Any] = ()) -> Progress | None:
    """A ``Progress`` for this compute, or ``None`` when progress is off."""
    if not wanted():
        return None
    try:
        position = 1 if _dask_bar_active(callbacks) else None
        return Progress(state, interval=config.seconds("progress.interval"), position=position)
    except Exception:  # a display must never stop a compute
        logger.warning("raydag: no progress display", exc_info=True)
        return None
