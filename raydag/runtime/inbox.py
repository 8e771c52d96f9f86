"""The inbox: a small actor on the driver's node that hears where and when copies start,
and sends the driver's cancels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from raydag.runtime.cluster import session

logger = logging.getLogger(__name__)


class Inbox:
    """Where tasks not known to be cheap say where and when they started; and where
    the driver's cancels go out from (see ``cancel``).

    Ray tells the driver nothing of a task until it ends (its state API needs the
    dashboard), yet a duplicate must avoid the original's node, a task's runtime
    counts from its real start, not from its submission (it may wait for a worker
    process), and a running task holds its inputs when the node that made them dies.
    The one-way call costs the worker about half a millisecond: it goes from a thread
    of the worker, and for a task not measured yet only once it has run
    ``Submit.notify_after`` (``raydag.runtime.worker``). The driver keeps one
    ``drain`` in flight, among the refs it waits on: it returns as soon as a note
    arrives (or after ``hold`` seconds), so a start is heard at once, not at the
    next poll.
    """

    def __init__(self) -> None:
        self.notes: list[tuple] = []
        self.waiting: dict[int, Any] = {}  # run -> the asyncio.Event its drain awaits

    async def started(self, run: int, tag: tuple, node: str, t: float) -> None:
        self.notes.append((run, tag, node, t))
        if (arrived := self.waiting.get(run)) is not None:
            arrived.set()

    async def drain(self, run: int, hold: float = 0.0) -> list[tuple]:
        """Run ``run``'s notes; none yet: wait up to ``hold`` s for the first. Each run
        drains its own: a drain left behind by an ended compute takes no other's."""
        import asyncio

        mine = [n for n in self.notes if n[0] == run]
        if not mine and hold > 0:
            arrived = self.waiting[run] = asyncio.Event()
            try:
                await asyncio.wait_for(arrived.wait(), hold)
            except asyncio.TimeoutError:
                pass
            finally:
                if self.waiting.get(run) is arrived:
                    del self.waiting[run]
            mine = [n for n in self.notes if n[0] == run]
        if mine:  # and the notes of ended computes nobody drained, after a while
            stale = time.time() - 600.0
            self.notes = [n for n in self.notes if n[0] != run and n[3] > stale]
        return mine

    async def cancel(self, boxed: list, force: bool) -> None:
        for ref in boxed:
            try:
                ray.cancel(ref, force=force)
            except Exception as e:  # one that cannot be cancelled stops no other
                logger.warning("raydag: could not cancel a task: %s", e)


_inbox: tuple[Any, Any] | None = None  # (the Ray session, the actor handle)


def inbox() -> Any:
    """This driver's inbox actor on its own node, started on first use, one per Ray session."""
    global _inbox
    ctx = ray.get_runtime_context()
    here_session = session()
    if _inbox is None or _inbox[0] != here_session:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # Hard affinity: the driver's node lives as long as the driver does, and an
        # inbox elsewhere would lose its notes with that node (soft affinity let Ray
        # put it on a worker node now and then).
        here = NodeAffinitySchedulingStrategy(ctx.get_node_id(), soft=False)
        actor = (
            ray.remote(Inbox)
            .options(num_cpus=0, max_restarts=-1, scheduling_strategy=here)
            .remote()
        )
        _inbox = (here_session, actor)
    return _inbox[1]


def cancel(refs: Sequence[ray.ObjectRef], force: bool) -> None:
    """Cancel the Ray tasks of ``refs`` from the inbox, not from this process.

    Ray 2.60 aborts the process that owns a task when that process's own
    ``ray.cancel`` meets the task's reply (a check fails in its core worker: see
    docs/ray-bugs.md). A cancel from another process reaches the owner as a request, handled on
    the same thread as the replies, one after the other.
    """
    if refs:
        inbox().cancel.remote(list(refs), force)  # in a list: refs, not their values
