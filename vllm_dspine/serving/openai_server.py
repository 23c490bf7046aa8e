"""`vllm serve` as a subprocess: started on loopback with any `vllm serve` flags (DSpine's
`--speculative-config` among them), waited for until /health answers, read through
/metrics, stopped together with every process it started. The one launcher the
benchmarks (bench/serve.py) and the tests (tests/test_serve.py, tests/test_ray_serve.py)
use; a notebook, an example or a supervisor can use it the same way:

    from vllm_dspine.serving.openai_server import VllmServer

    srv = VllmServer(target, ["--speculative-config", json.dumps(spec)], "serve.log")
    try:
        srv.wait_up(600)
        ...  # requests to srv.base + "/v1/completions"
    finally:
        srv.stop()

The server runs in its own session, so `stop` can end its engine processes too (vLLM's
API server starts an engine core and workers as children): SIGTERM to the server (it
shuts its engine down itself), a bounded wait for the whole process group, SIGKILL to the
group, and an error if anything of it survives. Every wait is bounded. Standard library
only (urllib), besides the CPU defaults of `vllm_dspine.cpu_env`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from vllm_dspine.serving.metrics import metric_page

HOST = "127.0.0.1"  # servers started here listen on loopback only


def free_port(host: str = HOST) -> int:
    """A TCP port nothing listens on at `host` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def vllm_executable() -> str:
    """The `vllm` command of this Python's environment (else the one on PATH)."""
    return shutil.which("vllm", path=os.path.dirname(sys.executable)) or "vllm"


def process_group_members(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid` (from /proc; empty where /proc is
    missing)."""
    out = []
    for d in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after ')'.
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def stop_process_group(proc: subprocess.Popen, grace: float = 60, log=print) -> None:
    """Ends `proc` and every process of its group (it was started with
    start_new_session, so its group id is its pid): SIGTERM to `proc` alone (vLLM's
    server then shuts its engine processes down itself), a wait of at most `grace`
    seconds for the whole group, then SIGKILL to the group; raises RuntimeError if
    anything of it is alive afterwards. Safe to call again."""
    pgid = proc.pid

    def alive() -> list[int]:
        proc.poll()
        return process_group_members(pgid) if os.path.isdir("/proc") else (
            [] if proc.returncode is not None else [pgid])

    if not alive():
        return
    if proc.poll() is None:
        proc.terminate()
    deadline = time.time() + grace
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    left = alive()
    if left:
        log(f"  still running after {grace:.0f} s: {left}; SIGKILL")
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.time() + 30
        while alive() and time.time() < deadline:
            time.sleep(0.5)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    left = alive()
    if left:
        raise RuntimeError(f"processes {left} of group {pgid} survived SIGKILL")


class VllmServer:
    """`vllm serve TARGET --host 127.0.0.1 --port P ARGS...` in its own session, its
    output in `log_path`.

    The constructor returns at once (the engine comes up in the background, so a caller
    can start other work meanwhile); `wait_up` waits, bounded, for /health; `stop` ends
    the whole process group, bounded. `env`: the server's environment (default: this
    process's, with the CPU defaults of `vllm_dspine.cpu_env` set in it)."""

    def __init__(self, target: str, args: Sequence[str], log_path,
                 env: dict | None = None) -> None:
        if env is None:
            from vllm_dspine.cpu_env import set_cpu_defaults

            set_cpu_defaults()
            env = dict(os.environ)
        self.port = free_port()
        self.base = f"http://{HOST}:{self.port}"
        self.log_path = str(log_path)
        self.cmd = [vllm_executable(), "serve", str(target), "--host", HOST,
                    "--port", str(self.port), *args]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def is_up(self) -> bool:
        """True once /health answers 200; raises RuntimeError if the server exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({self.proc.returncode}):\n"
                               f"{self.log_tail()}")
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_up(self, timeout: float = 400) -> VllmServer:
        """Polls /health every second until it answers (returns self) or `timeout`
        seconds pass (RuntimeError with the log's tail)."""
        deadline = time.time() + timeout
        while not self.is_up():
            if time.time() > deadline:
                raise RuntimeError(f"vllm serve not up in {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(1)
        return self

    def metrics_text(self) -> str:
        """The server's /metrics page (Prometheus text)."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            return r.read().decode()

    def metrics(self) -> dict[str, float]:
        """/metrics as `vllm_dspine.serving.metrics.metric_page` reads it: every metric
        summed over its labels (histogram buckets also by bound)."""
        return metric_page(self.metrics_text())

    def omp_cores(self) -> str | None:
        """The cores vLLM's CPU worker bound its OpenMP threads to (from its log)."""
        with open(self.log_path, errors="replace") as f:
            m = re.findall(r"local_rank=\d+, core ids=(\[[^\]]*\])", f.read())
        return m[-1] if m else None

    def stop(self, grace: float = 60, log=print) -> None:
        """Ends the server and every process it started (`stop_process_group`)."""
        stop_process_group(self.proc, grace=grace, log=log)
