"""The graveyard: refs of cancelled Ray tasks, held until each task has ended."""

from __future__ import annotations

import threading

import ray

from raydag.runtime.cluster import session


class Graveyard:
    """The refs of cancelled Ray tasks, held until each task has ended.

    Ray (2.60) can keep a cancelled task's value pinned in the object store for good,
    referenced by nobody, when the driver drops the task's refs before it has ended:
    seen under load, for a task cancelled while its worker process was starting. Refs
    dropped once the task has ended free its value as usual. A thread waits for the
    ends, so that neither a compute nor its error waits for them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)
        self._held: dict[ray.ObjectRef, tuple[tuple, tuple[str, str]]] = {}
        self._thread: threading.Thread | None = None

    def hold(self, meta_ref: ray.ObjectRef, value_refs: tuple) -> None:
        here = session()
        with self._lock:
            self._held[meta_ref] = (value_refs, here)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._reap, name="raydag-graveyard", daemon=True
                )
                self._thread.start()
            self._more.notify()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _reap(self) -> None:
        while True:
            with self._lock:
                while not self._held:
                    self._more.wait()
            self._bury_ended()  # its locals, refs among them, go when it returns

    def _bury_ended(self) -> None:
        with self._lock:
            held = {r: s for r, (_, s) in self._held.items()}
        try:
            now = session() if ray.is_initialized() else None
        except Exception:  # Ray shutting down
            now = None
        # refs of an earlier Ray session never end: let them go
        ended = [r for r, s in held.items() if s != now]
        waiting = [r for r, s in held.items() if s == now]
        if waiting:
            try:
                ended += all_ended(waiting, timeout=0.5, fetch_local=False)
            except Exception:  # Ray shut down meanwhile: its refs mean nothing now
                ended = list(held)
        with self._lock:
            for r in ended:
                self._held.pop(r, None)


graveyard = Graveyard()
hold_until_ended = graveyard.hold


def all_ended(refs: list, timeout: float, fetch_local: bool = True) -> list:
    """Every ref of ``refs`` ready once the first is (or none after ``timeout`` s)."""
    ready, _ = ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=fetch_local)
    if not ready:
        return []
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=fetch_local)
    return ready
