"""raydag.compat: every private API of Ray, dask and coffea resolves on the installed
versions, and where one is missing the guard falls back or says clearly what is lost.

Also: every module raydag imports is a declared dependency (pyproject.toml).
"""

from __future__ import annotations

import ast
import logging
import pathlib
import sys

import dask
import pytest
import ray

from raydag import compat
from raydag.runtime import stores

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def missing(monkeypatch):
    """``missing("mod:attr", ...)``: those look-ups fail, as in a release without them."""
    real = compat._import

    def make_missing(*paths: str) -> None:
        def fake(path: str):
            if any(path == p or path.startswith((p + ".", p + ":")) for p in paths):
                raise ImportError(f"No module or name {path!r} (made missing by the test)")
            return real(path)

        monkeypatch.setattr(compat, "_import", fake)

    compat.reset()
    yield make_missing
    monkeypatch.undo()
    compat.reset()


def said(caplog, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == compat.__name__ and r.levelno == level
    ]


# ---- each private API resolves on the installed versions ---------------------------


def test_task_spec_names_are_dasks():
    import dask._task_spec as private

    for name in compat.TASK_SPEC_NAMES:
        assert getattr(compat, name) is getattr(private, name), name
    try:
        import dask.task_spec as public
    except ImportError:
        public = None
    for name, source in compat.TASK_SPEC_SOURCES.items():
        assert source == ("dask.task_spec" if hasattr(public, name) else "dask._task_spec")
    assert compat.TASK_SPEC_SOURCES["Task"] == "dask.task_spec"  # public since 2025.1


def test_available_resources_per_node(ray_cluster):
    from ray._private.state import available_resources_per_node

    assert compat._resources_per_node() is available_resources_per_node
    node = ray.get_runtime_context().get_node_id()
    # this node's available resources (its CPUs may all be busy: Ray then lists none)
    free = compat.available_resources_per_node()[node]
    assert free.get("object_store_memory", 0) > 0 and free.get("CPU", 0) >= 0


@pytest.mark.parametrize("soft", [True, False])
def test_node_affinity(soft):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    assert compat._spills()
    s = compat.node_affinity("ab" * 28, soft)
    assert isinstance(s, NodeAffinitySchedulingStrategy)
    assert (s.node_id, s.soft, s._spill_on_unavailable) == ("ab" * 28, soft, soft)
    # soft, not spilled: elsewhere only if the node is gone, else it waits for a CPU there
    s = compat.node_affinity("ab" * 28, soft, spill=False)
    assert (s.soft, s._spill_on_unavailable) == (soft, False)


def test_raylet_stats(ray_cluster):
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    request = compat.node_stats_request()
    assert isinstance(request, node_manager_pb2.GetNodeStatsRequest)
    assert compat._max_grpc_message_size() == ray._config.max_grpc_message_size()
    n = next(n for n in ray.nodes() if n["Alive"])
    channel, stub = compat.raylet_stub(f"{n['NodeManagerAddress']}:{n['NodeManagerPort']}")
    try:
        assert isinstance(stub, node_manager_pb2_grpc.NodeManagerServiceStub)
        reply = stub.GetNodeStats(request, timeout=10)
        stats = stores.StoreStats.from_proto(reply.store_stats)
        assert stats.capacity_bytes > 0
    finally:
        channel.close()
    assert stores.store_stats()  # and raydag.runtime.stores reads through it


def test_shuffle_classes():
    from dask.dataframe.dask_expr._shuffle import Shuffle, SimpleShuffle

    assert compat.shuffle_classes() == (Shuffle, SimpleShuffle)
    from raydag.compat import SimpleShuffle as lazy

    assert lazy is SimpleShuffle and compat.Shuffle is Shuffle
    with pytest.raises(AttributeError, match="no attribute"):
        compat.NoSuchThing  # noqa: B018


def test_dataframe_concat():
    pd = pytest.importorskip("pandas")
    from dask.dataframe.core import _concat

    assert compat._concat() is _concat
    frames = [
        pd.DataFrame({"a": [1, 2]}, index=[5, 6]),
        pd.DataFrame({"a": []}, dtype="int64"),
        pd.DataFrame({"a": [3]}, index=[7]),
    ]
    for ignore_index in (False, True):
        expected = _concat(frames, ignore_index)
        pd.testing.assert_frame_equal(compat._own_concat(frames, ignore_index), expected)
        pd.testing.assert_frame_equal(compat.dataframe_concat(frames, ignore_index), expected)
    empty = [pd.DataFrame({"a": []}, dtype="int64")] * 2
    pd.testing.assert_frame_equal(compat._own_concat(empty), _concat(empty))


def test_coffea_helpers():
    pytest.importorskip("coffea")
    from coffea.processor import executor
    from coffea.processor.accumulator import accumulate

    assert compat.coffea_helpers() == (
        executor._compression_wrapper,
        executor._decompress,
        executor._reduce,
    )
    # raydag's copies (the fallback) make and read what coffea's do
    ours = compat._CompressionWrapper(1, lambda x: {"n": x}, name="f")
    theirs = executor._compression_wrapper(1, lambda x: {"n": x}, name="f")
    assert str(ours) == str(theirs) == "f"
    assert executor._decompress(ours(3)) == compat._decompress(theirs(3)) == {"n": 3}
    parts = [ours(1), ours(2), None, ours(4)]
    assert compat._decompress(compat._Reduce(1)(parts)) == {"n": 7}
    assert executor._decompress(executor._reduce(1)(parts)) == {"n": 7}
    assert compat._Reduce(None)([{"n": 1}, {"n": 2}]) == accumulate([{"n": 1}, {"n": 2}])


# ---- a missing private API: the fallback, or a clear message, said once -------------


def test_task_spec_missing_says_which_dask(missing):
    missing("dask.task_spec")  # the public module gone: all from the private one
    assert set(src for src, _ in compat._task_spec().values()) == {"dask._task_spec"}
    missing("dask.task_spec", "dask._task_spec:Task")
    with pytest.raises(compat.MissingAPI, match=rf"Task .* dask {dask.__version__} has neither"):
        compat._task_spec()


def test_available_resources_missing(missing, caplog):
    missing("ray._private.state:available_resources_per_node")
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        assert compat.available_resources_per_node() == {}
        assert compat.available_resources_per_node() == {}
    (message,) = said(caplog, logging.WARNING)
    assert "available_resources_per_node" in message and f"ray {ray.__version__}" in message
    assert "no speculative duplicates" in message


def test_spill_parameter_missing(missing, monkeypatch, caplog):
    class OldStrategy:  # a NodeAffinitySchedulingStrategy before _spill_on_unavailable
        def __init__(self, node_id: str, soft: bool) -> None:
            self.node_id, self.soft = node_id, soft

    real = compat._import
    monkeypatch.setattr(
        compat,
        "_import",
        lambda path: (
            OldStrategy if path.endswith(":NodeAffinitySchedulingStrategy") else real(path)
        ),
    )
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        s = compat.node_affinity("ab" * 28, True)
        compat.node_affinity("ab" * 28, True)
    assert isinstance(s, OldStrategy) and s.soft
    (message,) = said(caplog, logging.WARNING)
    assert "_spill_on_unavailable" in message and "waits for its node" in message


def test_grpc_utils_missing_turns_store_sampling_off(missing, caplog):
    missing("ray._private.grpc_utils")
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        assert compat.node_stats_request() is None
        assert stores.StoreReader().read() == {}  # no stats, no error: nothing to sample
        with pytest.raises(compat.MissingAPI, match="store sampling is off"):
            compat.raylet_stub("127.0.0.1:1")
    (message,) = said(caplog, logging.WARNING)
    assert message.startswith("raydag: store sampling needs ray._private.grpc_utils")
    assert f"which ray {ray.__version__} lacks" in message
    assert message.endswith("placement and store figures are off")


def test_store_stats_fields_missing(missing, monkeypatch, caplog):
    monkeypatch.setattr(compat, "STORE_FIELDS", (*compat.STORE_FIELDS, "no_such_field"))
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        assert compat.node_stats_request() is None
    (message,) = said(caplog, logging.WARNING)
    assert "ObjectStoreStats has no no_such_field" in message


def test_grpc_message_size_missing(missing, caplog):
    missing("ray:_config.max_grpc_message_size")
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        assert compat._max_grpc_message_size() == compat.DEFAULT_GRPC_MESSAGE_SIZE
    (message,) = said(caplog, logging.INFO)
    assert "max_grpc_message_size" in message


def test_shuffle_missing_says_which_dask(missing):
    missing("dask.dataframe.dask_expr._shuffle:Shuffle._lower")
    with pytest.raises(compat.MissingAPI, match=rf"'raydag' shuffle .* dask {dask.__version__}"):
        compat.shuffle_classes()
    with pytest.raises(compat.MissingAPI):
        from raydag.compat import SimpleShuffle  # noqa: F401


def test_shuffle_parameter_missing(missing, monkeypatch):
    monkeypatch.setattr(compat, "SHUFFLE_PARAMETERS", ("frame", "no_such_parameter"))
    with pytest.raises(compat.MissingAPI, match="Shuffle has no parameter no_such_parameter"):
        compat.shuffle_classes()


def test_concat_missing_falls_back(missing, caplog):
    pytest.importorskip("pandas")
    missing("dask.dataframe.core:_concat")
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        assert compat._concat() is compat._own_concat
    (message,) = said(caplog, logging.INFO)
    assert "dask.dataframe.methods.concat" in message


def test_coffea_helpers_missing_fall_back(missing, caplog):
    pytest.importorskip("coffea")
    missing("coffea.processor.executor:_reduce")
    with caplog.at_level(logging.INFO, logger=compat.__name__):
        helpers = compat.coffea_helpers()
    assert helpers == (compat._CompressionWrapper, compat._decompress, compat._Reduce)
    (message,) = said(caplog, logging.INFO)
    assert "coffea" in message and "own copies" in message


# ---- the packaging: what raydag imports is what it declares -------------------------


def test_plain_install_checks(ray_cluster):
    """tests/plain_install.py's compute, run record and report, here on the shared Ray
    (``nox -s plain`` runs it alone, in a venv of raydag's own dependencies only)."""
    import plain_install

    plain_install.main()


# Import names whose distribution is called otherwise.
DISTRIBUTION = {"yaml": "pyyaml", "grpc": "grpcio", "IPython": "ipython"}
# Imported only where they are there: raydag.coffea (the hep extra, which brings lz4),
# the notebook check in raydag.progress.
OPTIONAL = {"coffea", "lz4", "IPython"}


def _imports() -> dict[str, set[str]]:
    """Top-level modules raydag's own files import (but the standard library's): where."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "raydag").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "raydag":
                    out.setdefault(top, set()).add(path.name)
    # grpc through Ray's raylet stubs and ray._private.grpc_utils (raydag.compat)
    out.setdefault("grpc", set()).add("compat.py")
    return out


def test_every_import_is_a_declared_dependency():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(r).name.lower() for r in project["dependencies"]}
    imported = _imports()
    undeclared = {
        m: where
        for m, where in imported.items()
        if m not in OPTIONAL and DISTRIBUTION.get(m, m).lower() not in declared
    }
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"
    unused = declared - {DISTRIBUTION.get(m, m).lower() for m in imported}
    assert not unused, f"declared but never imported: {unused}"


def test_optional_imports_are_guarded():
    """``import raydag`` imports no optional module (and not dask.dataframe either)."""
    code = (
        "import sys, raydag, raydag.compat, raydag.runtime.stores;"
        "bad = [m for m in ('coffea', 'lz4', 'IPython', 'dask.dataframe') if m in sys.modules];"
        "assert not bad, bad"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_version_is_the_distributions():
    import importlib.metadata

    import raydag

    assert raydag.__version__ == importlib.metadata.version("raydag")
