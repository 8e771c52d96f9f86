"""``ray job submit`` of examples/hep_skim.py to a ``ray start --head`` cluster with token auth.

The cluster is this test's own: loopback only, its own temp dir and ports, token
authentication on with a token of its own (never ``~/.ray/auth_token``). It is ended by
the PIDs of the processes it started: ``ray stop`` would end every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.hep,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in ("coffea", "dask_histogram", "aiohttp")),
        reason="needs the HEP stack and Ray's dashboard: pip install -e .[hep]",
    ),
]

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_range(width: int) -> int:
    """The first port of ``width`` consecutive free ports (for Ray's worker ports),
    below the kernel's ephemeral range: ``free_ports``'s ports, like every outgoing
    connection's, come from that range, and once collided with this one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        low = 32768
    for _ in range(200):
        base = secrets.randbelow(low - 10000 - width) + 10000
        try:
            for p in range(base, base + width):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


def end_tree(root: psutil.Process, extra: list[psutil.Process]) -> None:
    """SIGTERM, then SIGKILL, every process of the cluster, by PID."""
    procs = {p.pid: p for p in extra}
    with contextlib.suppress(psutil.NoSuchProcess):
        procs.update({p.pid: p for p in root.children(recursive=True)})
    procs[root.pid] = root
    for p in procs.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(list(procs.values()), timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=10)


def cluster_logs(temp_dir: str) -> str:
    """The tails of the head's dashboard and job logs, for a failure message."""
    logs = Path(temp_dir) / "session_latest" / "logs"
    parts = []
    paths = [logs / "dashboard.log", logs / "dashboard.err", logs / "dashboard_agent.log"]
    paths += [logs / "dashboard_JobHead.log", *sorted(logs.glob("job-driver-*"))]
    for path in [p for p in paths if p.exists()]:
        text = path.read_text(errors="replace")[-1500:]
        parts.append(f"--- {path.name}\n{text}")
    return "\n".join(parts)


def ray_cli(*args: str, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ray"), *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_job_submit_hep_skim(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rdjob", dir="/tmp")  # short: unix socket paths
    token = tmp_path / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token),
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",  # the job's `python` is this one
    )
    gcs, dash, client, nm, om, agent, agent_grpc, renv, metrics = free_ports(9)
    workers = free_range(40)
    log = open(tmp_path / "head.log", "w")  # noqa: SIM115 (closed below)
    head = subprocess.Popen(
        [
            str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
            "--node-ip-address=127.0.0.1", f"--port={gcs}", f"--temp-dir={temp_dir}",
            "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
            f"--node-manager-port={nm}", f"--object-manager-port={om}",
            f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--runtime-env-agent-port={renv}", f"--metrics-export-port={metrics}",
            f"--min-worker-port={workers}", f"--max-worker-port={workers + 39}",
            '--system-config={"free_objects_period_milliseconds": 20}',
        ],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    root = psutil.Process(head.pid)
    seen: list[psutil.Process] = []
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:  # the job API answers once the head is up
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            if ray_cli("job", "list", "--address", address, env=env).returncode == 0:
                break
            assert time.monotonic() < deadline, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(2)
        seen += root.children(recursive=True)

        out = tmp_path / "out"
        sub_id = f"hep-skim-{secrets.token_hex(4)}"
        submit_args = [
            "job", "submit", "--no-wait", "--address", address, "--submission-id", sub_id,
            "--working-dir", str(REPO),  # without .git and what .gitignore names (.nox)
            "--", "python", "examples/hep_skim.py",
            "--files", "2", "--events", "3000", "--out", str(out),
        ]  # fmt: skip
        agent_log = Path(temp_dir) / "session_latest" / "logs" / "dashboard_agent.log"
        deadline = time.monotonic() + 180
        while not (agent_log.exists() and "agent http address" in agent_log.read_text()):
            assert time.monotonic() < deadline, cluster_logs(temp_dir)
            time.sleep(2)
        deadline = time.monotonic() + 240
        while True:  # the head's dashboard agent starts well after the API: until then
            submit = ray_cli(*submit_args, env=env)  # "No available agent", or a hang-up
            if submit.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(5)
        assert submit.returncode == 0, f"{submit.stderr[-2000:]}\n{cluster_logs(temp_dir)}"
        seen += root.children(recursive=True)
        deadline = time.monotonic() + 1200
        while True:
            status = ray_cli("job", "status", "--address", address, sub_id, env=env)
            state = (status.stdout + status.stderr).lower()
            if any(s in state for s in ("succeeded", "failed", "stopped")):
                break
            assert time.monotonic() < deadline, state
            seen += root.children(recursive=True)
            time.sleep(3)
        logs = ray_cli("job", "logs", "--address", address, sub_id, env=env).stdout
        detail = (
            f"{submit.stdout[-4000:]}\n{submit.stderr[-2000:]}\n{logs[-4000:]}\n"
            f"{cluster_logs(temp_dir)}"
        )
        (tmp_path / "job.log").write_text(logs)
        assert "succeeded" in state, detail
        # it ran on the job's cluster, not on an embedded Ray of its own
        assert f":{gcs}, job " in logs, detail
        assert "equal in every run" in logs, detail
        for name in ("sync", "raydag", "runner"):
            assert list((out / f"skim-{name}").glob("*.parquet")), f"no parquet for {name}"

        # authentication is on: the job API refuses a request without the token
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{address}/api/jobs/", timeout=10)
        assert refused.value.code in (401, 403)
    finally:
        end_tree(root, seen)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
    leftover = [p.pid for p in seen + [root] if p.is_running() and p.status() != "zombie"]
    assert not leftover, f"processes left running: {leftover}"
