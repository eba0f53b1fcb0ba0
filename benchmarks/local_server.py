"""`quanta serve` as a child process on a free localhost port, for the benchmarks that load it (soak.py,
serving_overhead.py): started and waited for until /health answers, stopped with SIGTERM and, past a grace
period, SIGKILL."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: str, flags: list[str], env: dict | None = None, log=subprocess.DEVNULL,
          ready_s: float = 300) -> tuple[subprocess.Popen, str]:
    """(the server process, its base URL) once /health answers; SystemExit if it exits or is not healthy
    within `ready_s` seconds (then it is killed)."""
    port = free_port()
    cmd = [sys.executable, "-m", "quanta.cli.main", "-q", "serve", model, "--host", "127.0.0.1", "--port", str(port),
           *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT if log is not None else None)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"quanta serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    stop(proc, grace_s=0)
    raise SystemExit(f"quanta serve did not become healthy in {ready_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM (the server's graceful shutdown), SIGKILL if it has not exited after `grace_s` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
