"""Test sessions: lint, the newest dask, and the HEP stack's older dask (what dask-awkward pins);
the lowest supported versions (floor), and a plain install without extras (plain)."""

import os
import pathlib
import re
import shutil
import tempfile

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "tests", "tests_hep", "floor", "plain", "dask_suite"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def ensure_chromium(session: nox.Session) -> None:
    """tests/test_report.py opens the HTML report in a headless chromium.

    Installed with apt-get when it is missing and we may (root, Debian or Ubuntu);
    otherwise those tests skip, saying why.
    """
    if any(shutil.which(b) for b in BROWSERS):
        return
    if not shutil.which("apt-get") or not hasattr(os, "geteuid") or os.geteuid() != 0:
        session.warn("no chromium and cannot apt-get it: the report's browser tests will skip")
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run_install("apt-get", "update", "-qq", external=True, env=env)
    session.run_install(
        "apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium",
        external=True, env=env,
    )  # fmt: skip


@nox.session
def tests(session: nox.Session) -> None:
    """The newest dask and ray."""
    session.install("-e", ".[test]")
    ensure_chromium(session)
    session.run(
        "python", "-c", "import dask, ray; print('dask', dask.__version__, 'ray', ray.__version__)"
    )
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--durations=15", *session.posargs)


@nox.session
def tests_hep(session: nox.Session) -> None:
    """coffea + dask-awkward, which pin an older dask (2025.3.x).

    Everything but the multi-node fault tests (marked ``cluster``) and the tests of
    raydag's Ray layer alone (``ray_only``: cancels, Ctrl-C, the notebook display),
    and the state machine's randomised runs, simulations and simulated reports (``core_only``), which the
    tests session runs: the dask version plays no part in them, and they take half the
    suite's time. What does meet dask (graphs, collections, the
    shuffle's rewrite, order, callbacks) runs on both stacks.
    """
    session.install("-e", ".[test,hep]")
    ensure_chromium(session)
    session.run("python", "-c", "import dask, dask_awkward; print('dask', dask.__version__)")
    args = session.posargs or ["-m", "not cluster and not ray_only and not core_only"]
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--durations=15", *args)


# dask's own tests (they ship in dask's wheel), every compute sent to raydag by
# tests/dask_suite/raydag_everywhere.py, as distributed runs them on its scheduler.
# Tests no multi-process scheduler passes as written are listed there with the reason.
DASK_SUITE = [
    "dask.tests.test_delayed",
    "dask.array.tests.test_reductions",
    "dask.bag.tests.test_bag",
    "dask.dataframe.tests.test_reshape",
    "dask.dataframe.tests.test_hashing",
]  # test_merge_column_and_index passes too (218 tests, 2026-12-02), and test_multi is left
# out: their hundreds of small computes take minutes of CI time each (#19). For the same
# reason the 2-D reductions run on one dtype (f4), not three: 45 s of the session's 5 min.
DASK_SUITE_SKIP = "not (test_reductions_2D and (c8 or i4))"


@nox.session
def dask_suite(session: nox.Session) -> None:
    """A slice of dask's own test suite with raydag as every scheduler."""
    session.install("-e", ".[test]")
    session.env["PYTHONPATH"] = "tests/dask_suite"
    args = session.posargs or ["-k", DASK_SUITE_SKIP, "--pyargs", *DASK_SUITE]
    session.run(
        "pytest", "-p", "raydag_everywhere", "-q", "-p", "no:cacheprovider", "-rfE",
        "--durations=10", *args,
    )  # fmt: skip


@nox.session
def example(session: nox.Session) -> None:
    """The main job: a real example on an embedded local Ray."""
    session.install("-e", ".[test]")
    session.run("python", "examples/quickstart.py")


# Floors installed as they are declared, but those whose floor is another's: pyyaml's
# is dask's (raydag only calls safe_load), and 5.4.1 has no wheel for today's Pythons.
NOT_PINNED = {"pyyaml"}
# The fast subset: the state machine (dask.order, the task spec) but its randomised
# runs (minutes, and the same whatever the versions), computes of every kind of
# collection, every private API and tests/plain_install.py's checks (test_compat.py).
FLOOR_TESTS = ["tests/test_state.py", "tests/test_compute.py", "tests/test_compat.py"]
FLOOR_SKIP = "not test_random_"


def floors() -> dict[str, str]:
    """pyproject.toml's ``name>=version`` dependencies: {name: version}."""
    text = pathlib.Path("pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return dict(re.findall(r'^\s*"([A-Za-z0-9_.-]+)>=([^",;]+)"', deps, re.M))


@nox.session(reuse_venv=False)
def floor(session: nox.Session) -> None:
    """The lowest supported ray, dask, pyarrow, pandas, ... (pyproject's floors), fresh."""
    pins = {name: v for name, v in floors().items() if name.lower() not in NOT_PINNED}
    # Not in session.create_tmp(): that sets TMPDIR inside the venv, where Ray 2.52
    # refuses to put its temp_dir.
    with tempfile.TemporaryDirectory() as tmp:
        constraints = os.path.join(tmp, "floors.txt")
        with open(constraints, "w") as f:
            f.writelines(f"{name}=={v}\n" for name, v in pins.items())
        session.install("-c", constraints, "-e", ".[test]")
    session.run("python", "-c", FLOOR_CHECK, *(f"{n}=={v}" for n, v in pins.items()))
    args = session.posargs or [*FLOOR_TESTS, "-k", FLOOR_SKIP]
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--durations=5", *args)


FLOOR_CHECK = """
import sys, importlib.metadata as m
from packaging.version import Version
got = {p.split("==")[0]: m.version(p.split("==")[0]) for p in sys.argv[1:]}
print("installed:", ", ".join(f"{n}=={v}" for n, v in got.items()))
wrong = [p for p in sys.argv[1:] if Version(got[p.split("==")[0]]) != Version(p.split("==")[1])]
assert not wrong, f"not the floor: {wrong}"
"""


@nox.session(reuse_venv=False)
def plain(session: nox.Session) -> None:
    """``pip install .`` with no extras, fresh: a compute, its run record and its report."""
    session.install(".")
    session.run("python", "tests/plain_install.py")
