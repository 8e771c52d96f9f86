"""Test sessions: lint, the newest dask, and the HEP stack's older dask (what dask-awkward pins)."""

import nox

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["lint", "tests", "tests_hep"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def tests(session: nox.Session) -> None:
    """The newest dask and ray."""
    session.install("-e", ".[test]")
    session.run(
        "python", "-c", "import dask, ray; print('dask', dask.__version__, 'ray', ray.__version__)"
    )
    session.run("pytest", "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def tests_hep(session: nox.Session) -> None:
    """coffea + dask-awkward, which pin an older dask (2025.3.x)."""
    session.install("-e", ".[test,hep]")
    session.run("python", "-c", "import dask, dask_awkward; print('dask', dask.__version__)")
    session.run("pytest", "-q", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def example(session: nox.Session) -> None:
    """The main job: a real example on an embedded local Ray."""
    session.install("-e", ".[test]")
    session.run("python", "examples/quickstart.py")
