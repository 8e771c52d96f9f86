"""The report, opened in a real headless browser: its plots are drawn, nothing errs.

Debian's ``chromium`` loads the file offline (no network flags), runs Bokeh, and
the page's own check counts the plot canvases with pixels on them. The screenshot
must not be blank. ``nox -s tests`` installs chromium when it is missing and it
can (root with apt-get); elsewhere these tests skip, saying why.
Set ``RAYDAG_SCREENSHOT_DIR`` to keep the screenshots.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import dask
import dask.array as da
import pytest
from simrun import WALL0, Sim

import raydag
from raydag.observe.record import RunRecord
from raydag.observe.report import _drawn, write_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
    "--virtual-time-budget=15000",
    "--window-size=1400,2400",
]


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(
        "no chromium found (tried: " + ", ".join(BROWSERS) + "); `apt-get install chromium` "
        "or run `nox -s tests`, which installs it"
    )


def _chromium(html: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.iterdir()))}"
    cmd = [_browser(), *FLAGS, f"--user-data-dir={profile}", *args, html.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def check_in_browser(html: Path, tmp: Path, figures: int) -> Path:
    """Open ``html``; assert Bokeh drew ``figures`` plots, without errors; return a screenshot."""
    dom = _chromium(html, tmp, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    uncaught = [line for line in dom.stderr.splitlines() if "Uncaught" in line]
    assert not uncaught, uncaught
    root = re.search(r"<html[^>]*>", dom.stdout).group(0)
    assert "data-raydag-errors" not in root, root
    body = re.findall(r"<body[^>]*data-raydag-[^>]*>", dom.stdout)
    assert body, "the page's readiness check never ran:\n" + dom.stderr[-2000:]
    attrs = dict(re.findall(r'data-raydag-(\w+)="([^"]*)"', body[-1]))
    assert attrs["ok"] == "true", attrs
    assert int(attrs["drawn"]) >= figures, attrs

    png = tmp / f"{html.stem}.png"
    shot = _chromium(html, tmp, f"--screenshot={png}")
    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    keep = os.environ.get("RAYDAG_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(keep) / png.name)
    _assert_not_blank(png)
    return png


def _assert_not_blank(png: Path) -> None:
    try:
        from PIL import Image  # comes with bokeh
    except ImportError:
        assert png.stat().st_size > 50_000
        return
    img = Image.open(png).convert("RGB")
    assert img.size == (1400, 2400)
    top = img.crop((0, 0, 1400, 1400))
    colours = top.getcolors(maxcolors=1 << 20)
    assert len(colours) > 200, f"only {len(colours)} colours: a blank page?"
    white = sum(n for n, c in colours if min(c) > 245)
    assert white < 0.97 * 1400 * 1400, "the page is almost all white"
    # the timeline's category colours are there (Category10 blue and orange)
    rgb = {c for _, c in colours}
    assert (31, 119, 180) in rgb and (255, 127, 14) in rgb


@pytest.mark.core_only  # a simulated record: the same on every dask
def test_report_of_faults_in_browser(tmp_path):
    """A run with a retry, a node lost and recovered, a duplicate, then a failed one."""
    faults = Sim().run()
    failed = Sim(fail=True, kill_at=None, duplicate=False, wall=WALL0 + 4.0).run()
    html = write_report([faults, failed], tmp_path / "faults.html")
    text = html.read_text()
    assert "<script src=" not in text and "cdn.bokeh.org" not in text  # opens offline
    for marker in ("recomputed after a loss", "duplicate that won", "retried (3)", "failed (1)"):
        assert marker in text
    assert "node bbbbbbbb lost" in text and "recovery wave 1" in text
    check_in_browser(html, tmp_path, figures=4)


@pytest.mark.ray_only  # the dask version plays no part: once, in the tests session
def test_report_of_a_real_run_in_browser(ray_cluster, tmp_path):
    html = tmp_path / "real.html"
    with raydag.performance_report(html):
        x = da.random.default_rng(0).random((400, 400), chunks=100)
        dask.compute((x @ x.T).mean(), scheduler=raydag.ray_get)
    check_in_browser(html, tmp_path, figures=4)


@pytest.mark.core_only  # a simulated record: the same on every dask
def test_empty_report_in_browser(tmp_path):
    html = write_report(RunRecord.merge([]), tmp_path / "empty.html")
    dom = _chromium(html, tmp_path, "--dump-dom")
    assert 'data-raydag-ok="true"' in dom.stdout and "Uncaught" not in dom.stderr


@pytest.mark.core_only  # a simulated record: the same on every dask
def test_report_of_a_large_record_in_browser(tmp_path):
    """A record of the seed's shape on a simulated 20 x 4 cluster with a node evicted:
    the timeline draws a sample (every recomputed task among it), the rest counts all."""
    from simcluster import WALL0 as SIM_WALL0
    from simcluster import Cluster, seed_graph
    from simcluster import Sim as ClusterSim

    from raydag.observe.record import Recorder

    graph = seed_graph(6_000, subgraphs=4, combines=10, heavy=0, seed=3)
    sim = ClusterSim(
        graph, Cluster(nodes=20, cpus=4), policies=False, evictions=[(1500.0, 3)], poll=1.0
    )
    recorder = Recorder(graph, {sim.node_ids[i]: 4 for i in sim.alive}, clock=sim.clock,
                        wall=SIM_WALL0)  # fmt: skip
    sim.observers.append(recorder)
    result = sim.run()
    assert result.complete and result.waves >= 1
    rec = recorder.finish()
    tasks = rec.tasks
    assert len(tasks) == result.executions > 2_000
    recomputed = int((tasks.wave > 0).sum())
    assert recomputed > 0
    shown = _drawn(tasks, 1_000)
    assert len(shown) <= 1_001
    odd = int((shown.wave > 0).sum())  # every recomputed one, or half the room for them
    assert odd == recomputed if recomputed <= 500 else 0 < odd <= 501
    with dask.config.set({"raydag.record.report-timeline-tasks": 1_000}):
        html = write_report(rec, tmp_path / "large.html")
    text = html.read_text()
    assert f"{len(shown):,} of {len(tasks):,} task executions drawn" in text
    assert f"{len(tasks):,}" in text  # the summary counts every execution
    check_in_browser(html, tmp_path, figures=4)
    with dask.config.set({"raydag.record.report-timeline-tasks": 10**6}):
        full = write_report(rec, tmp_path / "full.html")
    assert "task executions drawn" not in full.read_text()
    assert html.stat().st_size < full.stat().st_size
