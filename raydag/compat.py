"""Every private API of Ray, dask and coffea that raydag uses, each behind a guard.

Private names move between releases without notice, so they are looked up here and
nowhere else, the public spelling first where one exists. Where one is missing:

- dask's task spec (``TaskRef``, ``Task``, ...): raydag cannot run; importing it
  raises ``MissingAPI`` naming the dask release and the name;
- a working fallback where raydag's use can be done another way (coffea's output
  compression, dask's partition concatenation, the gRPC message size), said once
  at INFO;
- otherwise the feature is off (store sampling, idle CPUs per node, spilling of soft
  placement) and a WARNING says once which release has it and what is lost; or, for
  what the user asked for explicitly (the ``"raydag"`` shuffle method), ``MissingAPI``.

Supported (and tested, ``tests/test_compat.py``): ray 2.52 and newer, dask 2025.3.0
and newer. dask-expr's and coffea's names are resolved on first use, so that importing
raydag imports neither dask.dataframe nor coffea.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import inspect
import logging
import pickle
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class MissingAPI(ImportError):
    """A private API raydag needs is not in the installed Ray, dask or coffea."""


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _import(path: str) -> Any:
    """``"package.module:attr.attr"``: the module, or the attribute in it.

    The one place names are looked up: a missing module or attribute is an ImportError
    (tests replace this function to make a name missing).
    """
    module, _, attrs = path.partition(":")
    obj = importlib.import_module(module)
    for attr in attrs.split(".") if attrs else ():
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ImportError(f"{module} has no {attrs}") from None
    return obj


_said: set[str] = set()
_said_lock = threading.Lock()


def _say(key: str, level: int, message: str) -> str:
    """Log ``message`` the first time ``key`` is said in this process; return it."""
    with _said_lock:
        first = key not in _said
        _said.add(key)
    if first:
        logger.log(level, "raydag: %s", message)
    return message


def _needs(feature: str, what: str, dist: str, error: BaseException, then: str) -> str:
    return f"{feature} needs {what}, which {dist} {version(dist)} lacks ({error}): {then}"


_cached: list[Any] = []


def _once(fn: Callable) -> Callable:
    """Resolve on first use, then keep it (``reset()`` forgets, for tests)."""
    cached = functools.cache(fn)
    _cached.append(cached)
    return cached


def reset() -> None:
    """Forget what was resolved and said (tests that make a name missing)."""
    for fn in _cached:
        fn.cache_clear()
    with _said_lock:
        _said.clear()


# ---- dask: the task spec ---------------------------------------------------------------

TASK_SPEC_NAMES = (
    "Alias",
    "DataNode",
    "Dict",
    "GraphNode",
    "List",
    "Task",
    "TaskRef",
    "convert_legacy_graph",
)


def _task_spec() -> dict[str, tuple[str, Any]]:
    """Each name: (the module it came from, the object), ``dask.task_spec`` first.

    dask 2025.3's public ``dask.task_spec`` has DataNode, GraphNode, List, Task and
    TaskRef; later ones add Alias; Dict and convert_legacy_graph are private only.
    """
    found = {}
    for name in TASK_SPEC_NAMES:
        for module in ("dask.task_spec", "dask._task_spec"):
            try:
                found[name] = (module, _import(f"{module}:{name}"))
                break
            except ImportError:
                continue
        else:
            raise MissingAPI(
                f"raydag needs dask's task spec: {name} in dask.task_spec or "
                f"dask._task_spec (dask 2025.3.0 and later have it); dask {version('dask')} "
                "has neither: install a supported dask"
            )
    return found


_spec = _task_spec()
TASK_SPEC_SOURCES = {name: src for name, (src, _) in _spec.items()}  # where each was found
_spec = {name: obj for name, (_, obj) in _spec.items()}
Alias = _spec["Alias"]
DataNode = _spec["DataNode"]
Dict = _spec["Dict"]
GraphNode = _spec["GraphNode"]
List = _spec["List"]
Task = _spec["Task"]
TaskRef = _spec["TaskRef"]
convert_legacy_graph = _spec["convert_legacy_graph"]
del _spec


# ---- Ray: resources, scheduling ----------------------------------------------------


@_once
def _resources_per_node() -> Callable[[], dict] | None:
    try:
        return _import("ray._private.state:available_resources_per_node")
    except ImportError as e:
        _say(
            "available_resources_per_node",
            logging.WARNING,
            _needs(
                "reading each node's idle CPUs",
                "ray._private.state.available_resources_per_node (ray 2.52 and later have it)",
                "ray",
                e,
                "every node counts as busy, so no speculative duplicates are started",
            ),
        )
        return None


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Each alive node's available resources, by node id (hex), as the GCS last heard.

    ``{}`` (every node busy) where this Ray has no such call.
    """
    fn = _resources_per_node()
    return {} if fn is None else fn()


@_once
def _spills() -> bool:
    """Whether NodeAffinitySchedulingStrategy takes ``_spill_on_unavailable``."""
    strategy = _import("ray.util.scheduling_strategies:NodeAffinitySchedulingStrategy")
    try:
        params = inspect.signature(strategy).parameters
    except (TypeError, ValueError):
        params = {}
    if "_spill_on_unavailable" in params:
        return True
    _say(
        "_spill_on_unavailable",
        logging.WARNING,
        _needs(
            "spilling a placed task to another node when its node has no CPU free",
            "NodeAffinitySchedulingStrategy's _spill_on_unavailable (ray 2.52 and later)",
            "ray",
            TypeError("no such parameter"),
            "a placed task waits for its node instead",
        ),
    )
    return False


def node_affinity(node: str, soft: bool, spill: bool = True) -> Any:
    """Ray's strategy for running on ``node``: only there (``soft=False``), or there if it
    can and elsewhere if that node is gone (``soft``) or, with ``spill``, has no CPU
    free when Ray schedules it (else it waits for one there)."""
    strategy = _import("ray.util.scheduling_strategies:NodeAffinitySchedulingStrategy")
    if soft and spill and _spills():
        return strategy(node, soft=True, _spill_on_unavailable=True)
    return strategy(node, soft=soft)


def end_actor(actor: Any) -> None:
    """End ``actor`` once the calls it was given before have run (Ray's
    ``__ray_terminate__``, queued behind them; ``ray.kill`` would cut them short)."""
    with contextlib.suppress(Exception):  # its node is gone: so is it
        actor.__ray_terminate__.remote()


# ---- Ray: task options, Dask-on-Ray callbacks (raydag.runtime.ray_hooks) ---------------

OPTION_UTILS = ("ray._common.ray_option_utils", "ray._private.ray_option_utils")


@_once
def _task_options_validator() -> Callable[..., None] | None:
    errors = []
    for where in OPTION_UTILS:
        try:
            return _import(f"{where}:validate_task_options")
        except ImportError as e:
            errors.append(e)
    _say(
        "validate_task_options",
        logging.INFO,
        _needs(
            "checking ray_remote_args before the compute",
            f"validate_task_options in {' or '.join(OPTION_UTILS)}",
            "ray",
            errors[-1],
            "bad options are reported by Ray when their task is submitted",
        ),
    )
    return None


def validate_task_options(options: dict) -> None:
    """Raise Ray's ``ValueError``/``TypeError`` for options a remote function's
    ``.options()`` would refuse (an unknown keyword, a wrong type, ``CPU`` in
    ``resources``); nothing where this Ray has no such check."""
    fn = _task_options_validator()
    if fn is not None:
        fn(dict(options), in_options=True)


RAY_DASK_CALLBACKS = "ray.util.dask.callbacks"
# RayDaskCallback's names that raydag reads: the active set, the per-callback tuple,
# the context manager that empties the active set during a compute.
RAY_DASK_CALLBACK_NAMES = ("RayDaskCallback", "RayCallback", "local_ray_callbacks", "CBS")


def ray_dask_callbacks() -> Any | None:
    """``ray.util.dask.callbacks`` if the process has imported it, else ``None``.

    Never imported here: importing ``ray.util.dask`` patches ``dask.persist`` (it adds
    ``ray_persist=True`` to every persist), which a raydag user must not get unasked.
    Without it, no ``RayDaskCallback`` can exist. ``MissingAPI`` when it lacks a name
    raydag reads.
    """
    import sys

    module = sys.modules.get(RAY_DASK_CALLBACKS)
    if module is None:
        return None
    missing = [n for n in RAY_DASK_CALLBACK_NAMES if not hasattr(module, n)]
    if missing or not hasattr(module.RayDaskCallback, "ray_active"):
        raise MissingAPI(
            f"RayDaskCallback hooks need {RAY_DASK_CALLBACKS}.{', '.join(missing or ['RayDaskCallback.ray_active'])}, "
            f"which ray {version('ray')} lacks"
        )
    return module


# ---- Ray: the raylet's GetNodeStats (raydag.stores) -----------------------------------

# The fields of Ray's ObjectStoreStats that raydag.stores reads.
STORE_FIELDS = (
    "object_store_bytes_used",
    "object_store_bytes_avail",
    "spilled_bytes_total",
    "num_local_objects",
    "object_store_bytes_primary_copy",
    "object_store_bytes_fallback",
    "num_object_store_primary_copies",
)
DEFAULT_GRPC_MESSAGE_SIZE = 512 * 1024 * 1024  # Ray's default max_grpc_message_size


@_once
def _raylet() -> tuple[Any, Any, Any] | None:
    """(init_grpc_channel, the NodeManagerService stub class, the stats request), or None."""
    try:
        init_channel = _import("ray._private.grpc_utils:init_grpc_channel")
        stub = _import("ray.core.generated.node_manager_pb2_grpc:NodeManagerServiceStub")
        pb2 = _import("ray.core.generated.node_manager_pb2")
        request = pb2.GetNodeStatsRequest(include_memory_info=False)
        fields = pb2.GetNodeStatsReply().store_stats.DESCRIPTOR.fields_by_name
        missing = [f for f in STORE_FIELDS if f not in fields]
        if missing:
            raise ImportError(f"ObjectStoreStats has no {', '.join(missing)}")
    except Exception as e:  # an ImportError, or a request or reply of another shape
        _say(
            "raylet",
            logging.WARNING,
            _needs(
                "store sampling",
                "ray._private.grpc_utils and the raylet's GetNodeStats of ray 2.52 and later",
                "ray",
                e,
                "placement and store figures are off",
            ),
        )
        return None
    return init_channel, stub, request


def node_stats_request() -> Any:
    """The raylet's ``GetNodeStatsRequest`` raydag sends; None where this Ray cannot."""
    api = _raylet()
    return None if api is None else api[2]


@_once
def _max_grpc_message_size() -> int:
    try:
        return int(_import("ray:_config.max_grpc_message_size")())
    except Exception as e:
        _say(
            "max_grpc_message_size",
            logging.INFO,
            f"ray {version('ray')} has no ray._config.max_grpc_message_size ({e}): "
            f"store-stats channels use Ray's default, {DEFAULT_GRPC_MESSAGE_SIZE} bytes",
        )
        return DEFAULT_GRPC_MESSAGE_SIZE


def raylet_stub(address: str) -> tuple[Any, Any]:
    """(a gRPC channel to the raylet at ``address``, its NodeManagerService stub).

    Ray's own ``init_grpc_channel`` adds token authentication and TLS as Ray is
    configured. ``MissingAPI`` where this Ray cannot (see ``node_stats_request``).
    """
    api = _raylet()
    if api is None:
        raise MissingAPI(f"store sampling is off with ray {version('ray')}: see the warning")
    init_channel, stub, _ = api
    size = _max_grpc_message_size()
    channel = init_channel(
        address,
        options=[
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
        ],
    )
    return channel, stub(channel)


# ---- dask: dask-expr's shuffle and the partitions' concatenation ---------------------

# Shuffle's parameters raydag's _lower passes on to RaydagShuffle.
SHUFFLE_PARAMETERS = (
    "frame",
    "partitioning_index",
    "npartitions_out",
    "ignore_index",
    "options",
    "original_partitioning_index",
)


@_once
def shuffle_classes() -> tuple[type, type]:
    """dask-expr's ``Shuffle`` (whose ``_lower`` raydag wraps) and ``SimpleShuffle``
    (``RaydagShuffle``'s base). Imports dask.dataframe."""
    where = "dask.dataframe.dask_expr._shuffle"
    try:
        shuffle = _import(f"{where}:Shuffle")
        simple = _import(f"{where}:SimpleShuffle")
        _import(f"{where}:Shuffle._lower")
        missing = [p for p in SHUFFLE_PARAMETERS if p not in getattr(shuffle, "_parameters", ())]
        if missing:
            raise ImportError(f"Shuffle has no parameter {', '.join(missing)}")
    except ImportError as e:
        raise MissingAPI(
            _needs(
                "the 'raydag' shuffle method",
                f"{where}.Shuffle._lower and SimpleShuffle (dask 2025.3.0 and later)",
                "dask",
                e,
                "set dataframe.shuffle.method to another method",
            )
        ) from e
    return shuffle, simple


def _own_concat(dfs: list, ignore_index: bool = False) -> Any:
    """dask's ``_concat`` for what a shuffle concatenates: frames, the empty left out."""
    methods = _import("dask.dataframe.methods")
    nonempty = [df for df in dfs if len(df)]
    if not nonempty:
        return dfs[0] if dfs else dfs
    return methods.concat(nonempty, uniform=True, ignore_index=ignore_index)


@_once
def _concat() -> Callable:
    try:
        return _import("dask.dataframe.core:_concat")
    except ImportError as e:
        _say(
            "_concat",
            logging.INFO,
            f"dask {version('dask')} has no dask.dataframe.core._concat ({e}): "
            "shuffle outputs are concatenated with dask.dataframe.methods.concat",
        )
        return _own_concat


def dataframe_concat(dfs: list, ignore_index: bool = False) -> Any:
    """dask.dataframe's concatenation of partitions (``dask.dataframe.core._concat``)."""
    return _concat()(dfs, ignore_index)


# ---- coffea: the executors' output compression and reduction --------------------------


class _CompressionWrapper:
    """Runs ``function`` and lz4-compresses its pickled output (coffea's own, copied)."""

    def __init__(self, level: int, function: Callable, name: str | None = None) -> None:
        self.level = level
        self.function = function
        self.name = name

    def __str__(self) -> str:
        return self.name or getattr(self.function, "__name__", str(self.function))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _compress(self.function(*args, **kwargs), self.level)


def _compress(item: Any, level: int | None) -> Any:
    if item is None or level is None:
        return item
    import lz4.frame

    return lz4.frame.compress(pickle.dumps(item, pickle.HIGHEST_PROTOCOL), level)


def _decompress(item: Any) -> Any:
    if not isinstance(item, bytes):
        return item
    import lz4.frame

    return pickle.loads(lz4.frame.decompress(item))


class _Reduce:
    """Merges outputs with coffea's ``accumulate``, compressed as they came."""

    def __init__(self, compression: int | None) -> None:
        self.compression = compression

    def __str__(self) -> str:
        return "reduce"

    def __call__(self, items: Any) -> Any:
        from coffea.processor.accumulator import accumulate

        items = [it for it in items if it is not None]
        if not items:
            raise ValueError("Empty list provided to reduction")
        if self.compression is None:
            return accumulate(items)
        out = _decompress(items.pop())
        return _compress(accumulate(map(_decompress, items), out), self.compression)


@_once
def coffea_helpers() -> tuple[Callable, Callable, Callable]:
    """coffea's ``_compression_wrapper``, ``_decompress`` and ``_reduce`` (all three from
    coffea, or all three raydag's copies: the compression is theirs to agree on)."""
    where = "coffea.processor.executor"
    _import(where)  # no coffea at all: raydag.coffea cannot work, and says so
    try:
        return (
            _import(f"{where}:_compression_wrapper"),
            _import(f"{where}:_decompress"),
            _import(f"{where}:_reduce"),
        )
    except ImportError as e:
        _say(
            "coffea",
            logging.INFO,
            f"coffea {version('coffea')} has no {where}._compression_wrapper, _decompress "
            f"or _reduce ({e}): raydag.coffea compresses and merges outputs with its own "
            "copies (lz4 and coffea's accumulate)",
        )
        return _CompressionWrapper, _decompress, _Reduce


_LAZY = {"Shuffle": 0, "SimpleShuffle": 1}


def __getattr__(name: str) -> Any:
    """dask-expr's classes, looked up when first imported from here (not with raydag)."""
    if name in _LAZY:
        return shuffle_classes()[_LAZY[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
