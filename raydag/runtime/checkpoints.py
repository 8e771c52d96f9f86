"""The checkpoint store: results written durably to any fsspec URL, read back whole or
not at all.

**Names.** A checkpoint is named ``<key token>-<fingerprint>``: the dask key's token
(``dask.base.tokenize``) and a fingerprint of the task's spec, its inputs'
fingerprints (transitively) and raydag's version. A later compute of the same graph
finds the same names; a changed task, a changed input anywhere above it or another
raydag version does not, and a file of one of its keys under another fingerprint is
stale: ignored, with a warning.

**Files.** ``<name>.data``: the value pickled with protocol 5 (Ray's cloudpickle), its
out-of-band buffers (numpy, pandas, Arrow, awkward arrays: no copy into the pickle)
after it, each at a 64-byte aligned offset; ``<name>.json``: the manifest (layout,
sizes, sha256 of the data, key, fingerprint, raydag's version), written last. Each is
written under a temporary name and moved into place; on stores where a move is no
atomic rename (object stores), the manifest written last still means that a value is
read only once whole, and its hash is checked on every read.

Worked example::

    store = CheckpointStore("file:///scratch/ckpt")
    store.write("ab12-cd34", value, {"key": "('x', 0)"})   # -> bytes written
    store.read("ab12-cd34")                                 # -> value, or CheckpointError
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import fsspec
import ray
import ray.cloudpickle
from dask.base import tokenize

logger = logging.getLogger("raydag.runtime")
Key = Hashable

ALIGN = 64
FORMAT = 1
DATA, MANIFEST = ".data", ".json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial, corrupt or of another task."""


def default_store() -> str:
    """``<the user's cache directory>/raydag/checkpoints``."""
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("raydag"), "checkpoints")


def version() -> str:
    import raydag

    return raydag.__version__


def fingerprints(tasks: Mapping[Key, Any], dependencies: Mapping[Key, Iterable[Key]]) -> dict:
    """Each key's fingerprint: its task's token, its inputs' fingerprints, raydag's
    version (a Merkle hash: a change anywhere above a key changes it)."""
    ver = version()
    done: dict[Key, str] = {}
    for top in tasks:
        stack = [top]
        while stack:
            k = stack[-1]
            if k in done:
                stack.pop()
                continue
            todo = [d for d in dependencies[k] if d not in done]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            deps = sorted(done[d] for d in dependencies[k])
            done[k] = tokenize(ver, tokenize(tasks[k]), deps)[:20]
    return done


def names(tasks: Mapping[Key, Any], dependencies: Mapping[Key, Iterable[Key]]) -> dict:
    """Each key's checkpoint name."""
    return {k: f"{key_token(k)}-{fp}" for k, fp in fingerprints(tasks, dependencies).items()}


def key_token(key: Key) -> str:
    return tokenize(key)[:20]


class CheckpointStore:
    """One checkpoint store (an fsspec URL). Picklable: Ray tasks write and read it."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._fs: Any = None
        self._root = ""

    def __reduce__(self) -> tuple:
        return (CheckpointStore, (self.url,))

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs, self._root = fsspec.core.url_to_fs(self.url)
        return self._fs

    def path(self, name: str, suffix: str) -> str:
        self.fs  # noqa: B018  (sets the root)
        return f"{self._root.rstrip('/')}/{name}{suffix}"

    def open(self) -> None:
        """Create the store's directory and write (then remove) a probe file in it:
        raises if either cannot be done (a read-only store is told at the start, by the
        driver, not by a write that a short compute may cancel before it fails)."""
        self.fs.makedirs(self.path("", "").rstrip("/"), exist_ok=True)
        probe = self.path(f".probe-{uuid.uuid4().hex[:8]}", DATA + ".tmp")
        with self.fs.open(probe, "wb") as f:
            f.write(b"raydag")
        self.fs.rm(probe)

    # ---- one checkpoint -----------------------------------------------------------

    def write(self, name: str, value: Any, meta: Mapping[str, Any]) -> int:
        """Write ``value`` whole under ``name``; the bytes written."""
        buffers: list = []
        head = ray.cloudpickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        digest = hashlib.sha256()
        offsets, sizes = [], []
        fs = self.fs
        data = self.path(name, DATA)
        tmp = f"{data}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with fs.open(tmp, "wb") as f:
                f.write(head)
                digest.update(head)
                pos = len(head)
                for v in views:
                    pad = -pos % ALIGN
                    if pad:
                        f.write(b"\0" * pad)
                        digest.update(b"\0" * pad)
                        pos += pad
                    f.write(v)
                    digest.update(v)
                    offsets.append(pos)
                    sizes.append(v.nbytes)
                    pos += v.nbytes
            fs.mv(tmp, data)
            manifest = {
                **meta,
                "format": FORMAT,
                "name": name,
                "raydag": version(),
                "pickle": len(head),
                "offsets": offsets,
                "sizes": sizes,
                "nbytes": pos,
                "sha256": digest.hexdigest(),
                "created": time.time(),
            }
            mtmp = f"{self.path(name, MANIFEST)}.tmp-{uuid.uuid4().hex[:8]}"
            with fs.open(mtmp, "w") as f:
                json.dump(manifest, f)
            fs.mv(mtmp, self.path(name, MANIFEST))
        except BaseException:
            for p in (tmp, f"{data}"):
                try:
                    if fs.exists(p) and not fs.exists(self.path(name, MANIFEST)):
                        fs.rm(p)
                except Exception:  # a read-only store: nothing was written anyway
                    pass
            raise
        return pos

    def manifest(self, name: str) -> dict:
        try:
            with self.fs.open(self.path(name, MANIFEST), "r") as f:
                manifest = json.load(f)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {name} has no manifest (partial)") from None
        except ValueError as e:
            raise CheckpointError(f"checkpoint {name}: unreadable manifest ({e})") from None
        if manifest.get("format") != FORMAT or manifest.get("name") != name:
            raise CheckpointError(f"checkpoint {name}: a manifest of another checkpoint")
        if manifest.get("raydag") != version():
            raise CheckpointError(
                f"checkpoint {name}: written by raydag {manifest.get('raydag')}, not {version()}"
            )
        return manifest

    def read(self, name: str) -> Any:
        """The value written under ``name``; ``CheckpointError`` unless whole."""
        manifest = self.manifest(name)
        nbytes = int(manifest["nbytes"])
        view = _aligned(nbytes)  # the buffers where they were written: aligned, writeable
        try:
            with self.fs.open(self.path(name, DATA), "rb") as f:
                got = f.readinto(view)
                extra = f.read(1)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {name}: its data is gone") from None
        if got != nbytes or extra:
            raise CheckpointError(f"checkpoint {name}: {got} bytes of data, not {nbytes}")
        if hashlib.sha256(view).hexdigest() != manifest["sha256"]:
            raise CheckpointError(f"checkpoint {name}: its data does not match its hash")
        buffers = [
            view[o : o + n] for o, n in zip(manifest["offsets"], manifest["sizes"], strict=True)
        ]
        return ray.cloudpickle.loads(view[: manifest["pickle"]], buffers=buffers)

    # ---- the whole store ------------------------------------------------------------

    def discard(self, names: Iterable[str]) -> int:
        """Remove these whole checkpoints (manifest first), without listing the store;
        the files removed."""
        return sum(self._rm(name, (MANIFEST, DATA)) for name in names)

    def _rm(self, name: str, suffixes: Iterable[str]) -> int:
        """Remove ``name``'s files with these suffixes, in this order; how many were there."""
        removed = 0
        for suffix in suffixes:
            try:
                self.fs.rm(self.path(name, suffix))
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def listing(self) -> dict[str, dict]:
        """Every file of the store by checkpoint name: ``{suffix: size}``."""
        try:
            entries = self.fs.ls(self.path("", "").rstrip("/"), detail=True)
        except FileNotFoundError:
            return {}
        found: dict[str, dict] = {}
        for e in entries:
            base = e["name"].rstrip("/").rsplit("/", 1)[-1]
            for suffix in (MANIFEST, DATA):
                if suffix in base:
                    name, _, rest = base.partition(suffix)
                    found.setdefault(name, {})[suffix + rest] = int(e.get("size") or 0)
                    break
        return found

    def find(self, names: Mapping[Key, str]) -> tuple[set, int, list]:
        """The keys whose checkpoints are in the store (a manifest and data, by name);
        how many checkpoints of these keys under other fingerprints (stale) it holds,
        and how many of theirs are partial (no manifest: a write cut short)."""
        files = self.listing()
        found = {k for k, n in names.items() if {MANIFEST, DATA} <= set(files.get(n, ()))}
        partial = [n for n in names.values() if n in files and MANIFEST not in files[n]]
        tokens = {n.split("-", 1)[0] for n in names.values()}
        ours = set(names.values())
        stale = sum(1 for n in files if n not in ours and n.split("-", 1)[0] in tokens)
        return found, stale, partial

    def remove(self, names: Iterable[str]) -> int:
        """Remove these checkpoints (manifest first: never data read without it), and
        their temporary files; the files removed."""
        files = self.listing()
        first = lambda s: not s.startswith(MANIFEST)  # noqa: E731
        return sum(self._rm(name, sorted(files.get(name, ()), key=first)) for name in names)


def _aligned(nbytes: int) -> memoryview:
    """``nbytes`` of fresh memory starting at an ``ALIGN``-byte boundary."""
    blob = bytearray(nbytes + ALIGN)
    address = ctypes.addressof((ctypes.c_char * 1).from_buffer(blob))
    start = -address % ALIGN
    return memoryview(blob)[start : start + nbytes]


def write_checkpoint(store: CheckpointStore, name: str, meta: dict, value: Any) -> int:
    return store.write(name, value, meta)


# A checkpoint is written beside the value's readers: no CPU of theirs (it waits on
# I/O), no retry (a failed write is reported, and checkpoints go off). A value whose
# node is unknown (inline in its owner) is written by such a task.
remote_write = ray.remote(num_cpus=0, max_retries=0)(write_checkpoint)


class Writer:
    """One node's checkpoint writer, for one compute: a process of its own that writes
    the node's values as they come (``WRITES_AT_ONCE`` at a time, threads: a write waits
    on I/O and hashing, both outside the GIL).

    Why an actor and not a task per write: a task with no CPU still needs a worker
    process, and while the compute runs the node's workers are all busy with its tasks,
    so Ray starts one for the write; idle a second later, beyond the node's CPU count,
    Ray ends it again. Writes more than a second apart (one per long task: the case
    checkpoints are for) each paid a worker's start: measured on 2 CPUs with 4-s tasks,
    12 worker processes started for 15 writes against 4 without checkpoints, 14.6 more
    CPU-seconds, 1.43x the makespan (bench/RESULTS.md, #20).

    The writer starts once per node and compute, at the node's first write, and every
    write of the node goes to it, even while it starts (Ray holds an actor's calls until
    it is up: the first checkpoints wait a process start, their values are safe in the
    object store meanwhile). It runs in a runtime env of its own (``WRITER_ENV``), so it
    never takes a worker process Ray keeps idle for the compute's tasks. Both measured
    (#20 (c), 2 CPUs, 2-s tasks, one driver): a writer that took an idle worker, or a
    write made as a task while the writer started, left the next task waiting 1.1-2 s
    for a process, in most computes (24.55-26.47 s against 24.48 s without checkpoints);
    with neither, 24.49-24.52 s.
    """

    def write(self, store: CheckpointStore, name: str, meta: dict, value: Any) -> int:
        return store.write(name, value, meta)

    def discard(self, store: CheckpointStore, names: list[str]) -> int:
        return store.discard(names)


WRITES_AT_ONCE = 2
# The writer's own runtime env (merged into the job's: the job's modules and env
# vars stay): a worker process of that env is the writer's alone.
WRITER_ENV = {"env_vars": {"RAYDAG_CHECKPOINT_WRITER": "1"}}


class ReadBack:
    """Stands for a key's task in a group: reads its value from its checkpoint."""

    __slots__ = ("key", "store", "name")

    def __init__(self, key: Key, store: CheckpointStore, name: str) -> None:
        self.key = key
        self.store = store
        self.name = name

    @property
    def dependencies(self) -> frozenset:
        return frozenset()

    def __call__(self, values: Mapping) -> Any:
        return self.store.read(self.name)


def open_store(url: str | None, names: Mapping[Key, str], resume: bool) -> tuple:
    """The store to write, the keys of this graph it holds (``resume``), and the names
    of this graph's partial checkpoints in it (removed with the others at the end). A
    store that cannot be created is reported and no checkpoints are written (``None``)."""
    store = CheckpointStore(url or default_store())
    try:
        store.open()
    except Exception as e:
        logger.warning(
            "raydag: cannot use the checkpoint store %s (%s: %s); the compute goes on "
            "without checkpoints",
            store.url,
            type(e).__name__,
            e,
        )
        return None, set(), []
    if not resume:
        return store, set(), []
    try:
        found, stale, partial = store.find(names)
    except Exception as e:
        logger.warning("raydag: cannot list the checkpoint store %s: %s", store.url, e)
        return store, set(), []
    if stale:
        logger.warning(
            "raydag: ignoring %d checkpoint files in %s of this graph's keys but of other "
            "tasks or another raydag version (stale; `python -m raydag checkpoints clean`)",
            stale,
            store.url,
        )
    if partial:
        logger.warning(
            "raydag: ignoring %d partial checkpoints in %s (no manifest: a write was cut "
            "short); their results are computed",
            len(partial),
            store.url,
        )
    if found:
        logger.info("raydag: %d results found in the checkpoint store %s", len(found), store.url)
    return store, found, partial


class Checkpointing:
    """The Ray layer's side of checkpoints for one compute: the writes in flight, the
    reads back, the removal at the end. Decides nothing (``raydag.core.checkpoints``)."""

    WAIT = 60.0  # at the end, for the writes still in flight

    def __init__(
        self, store: CheckpointStore, names: Mapping[Key, str], partial: Iterable[str] = ()
    ) -> None:
        self.store = store
        self.names = names
        self.partial = list(partial)  # this graph's partial checkpoints found at the start
        self.writes: dict[ray.ObjectRef, Key] = {}  # by the write's ref
        self.writers: dict[str, Any] = {}  # node -> its Writer
        self._by: dict[ray.ObjectRef, str] = {}  # a write's ref -> its writer's node
        # removals of superseded checkpoints by a writer, in flight: ref -> names
        self.discards: dict[ray.ObjectRef, list[str]] = {}

    def write(self, key: Key, ref: ray.ObjectRef, node: str | None = None) -> ray.ObjectRef:
        """Start writing ``key``'s value, held on ``node`` (None: unknown), beside its
        readers; the write's ref, for the loop to watch."""
        meta = {"key": repr(key)}
        writer = None if node is None else self._writer(node)
        if writer is None:
            write = remote_write.remote(self.store, self.names[key], meta, ref)
        else:
            write = writer.write.remote(self.store, self.names[key], meta, ref)
            self._by[write] = node  # type: ignore[assignment]
        self.writes[write] = key
        return write

    def _writer(self, node: str) -> Any:
        """``node``'s writer, started on the node's first write (there only: a write
        elsewhere would fetch the value over the network)."""
        writer = self.writers.get(node)
        if writer is None:
            from raydag.compat import node_affinity

            writer = (
                ray.remote(Writer)
                .options(
                    num_cpus=0,
                    max_concurrency=WRITES_AT_ONCE,
                    max_restarts=0,
                    scheduling_strategy=node_affinity(node, soft=False),
                    runtime_env=WRITER_ENV,
                )
                .remote()
            )
            self.writers[node] = writer
        return writer

    def close(self) -> None:
        """End the writers once their writes in flight are done (the compute is over:
        nothing is waited for here; a compute interrupted keeps what is being written)."""
        from raydag.compat import end_actor

        for writer in self.writers.values():
            end_actor(writer)
        self.writers.clear()
        self._by.clear()

    def ended(self, ref: ray.ObjectRef) -> Any:
        """The event a finished write means."""
        from raydag.core.events import CheckpointFailed, CheckpointWritten

        key = self.writes.pop(ref)
        node = self._by.pop(ref, None)
        try:
            return CheckpointWritten(key, int(ray.get(ref)))
        except ray.exceptions.RayActorError as e:  # its writer died: the next write starts one
            if node is not None:
                self.writers.pop(node, None)
            return CheckpointFailed(key, e, lost=True)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(e.cause, BaseException) else e
            # the store's own error, or Ray's (the value to write lost with its node)
            return CheckpointFailed(key, cause, lost=isinstance(cause, ray.exceptions.RayError))
        except ray.exceptions.RayError as e:  # its worker or node died
            return CheckpointFailed(key, e, lost=True)

    def read_back(self, key: Key) -> ReadBack:
        return ReadBack(key, self.store, self.names[key])

    def settle(self, cancel: bool = False) -> None:
        """Wait for the writes in flight to end (a compute done: they are kept, or
        removed); ``cancel``: stop them first, since what they write is to be removed."""
        if self.writes:
            refs = list(self.writes)
            if cancel:  # from the inbox, as every cancel (docs/ray-bugs.md)
                from raydag.runtime.inbox import cancel as cancel_tasks

                cancel_tasks(refs, force=False)
            ray.wait(refs, num_returns=len(refs), timeout=self.WAIT)
            self.writes.clear()
            self._by.clear()
        if self.discards:  # a removal its writer did not make (it died) is made here
            refs = list(self.discards)
            done = set(ray.wait(refs, num_returns=len(refs), timeout=self.WAIT)[0])
            for ref, names in self.discards.items():
                try:
                    if ref in done and ray.get(ref) is not None:
                        continue
                except ray.exceptions.RayError:
                    pass
                self._discard_here(names)
            self.discards.clear()

    def discard(self, keys: Iterable[Key]) -> None:
        """Remove written checkpoints that protect nothing any more, mid-compute (their
        writes have ended: they were reported written). By a writer that is up, off the
        driver's loop (on a remote store each removal is round trips); ``settle`` waits
        for them, and does itself what a writer could not."""
        names = [self.names[k] for k in keys]
        writer = next(iter(self.writers.values()), None)
        if writer is None:
            self._discard_here(names)
        else:
            self.discards[writer.discard.remote(self.store, names)] = names

    def _discard_here(self, names: list[str]) -> None:
        try:
            self.store.discard(names)
        except Exception as e:  # a store that cannot remove: a warning, the compute goes on
            logger.warning("raydag: cannot remove checkpoints from %s: %s", self.store.url, e)

    def drop(self, keys: Iterable[Key]) -> None:
        """Remove a done compute's checkpoints. Its writes still in flight are cancelled,
        not waited for: their values' readers all ran, so a write ending now would only be
        removed, and waiting for it would hold the compute's end (a write of the last
        results starts as the compute ends, often in a worker process Ray must start)."""
        self.settle(cancel=True)
        try:
            removed = self.store.remove([*(self.names[k] for k in keys), *self.partial])
            logger.debug("raydag: removed %d checkpoint files from %s", removed, self.store.url)
        except Exception as e:  # a read-only store: reported when it failed a write
            logger.warning("raydag: cannot remove checkpoints from %s: %s", self.store.url, e)
