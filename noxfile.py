"""Test sessions: lint, the newest dask, and the HEP stack's older dask (what dask-awkward pins)."""

import os
import shutil

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "tests", "tests_hep"]
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
    which the tests session runs: the dask version plays no part in them, and they
    take half the suite's time. What does meet dask (graphs, collections, the
    shuffle's rewrite, order, callbacks) runs on both stacks.
    """
    session.install("-e", ".[test,hep]")
    ensure_chromium(session)
    session.run("python", "-c", "import dask, dask_awkward; print('dask', dask.__version__)")
    args = session.posargs or ["-m", "not cluster and not ray_only"]
    session.run("pytest", "-q", "-p", "no:cacheprovider", "--durations=15", *args)


@nox.session
def example(session: nox.Session) -> None:
    """The main job: a real example on an embedded local Ray."""
    session.install("-e", ".[test]")
    session.run("python", "examples/quickstart.py")
