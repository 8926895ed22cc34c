"""Start and stop vLLM's OpenAI-compatible server as a child process (benchmarks and end-to-end tests).

``start([...server options])`` runs ``psd serve`` (or, with ``plain=True``, vLLM's API server without the
plugin's defaults, for AR baselines) on a free loopback port in its own session, waits for ``/health`` and
returns a :class:`Server` (its output goes to a log file, ``Server.log``, in ``$PSD_SERVER_LOG_DIR`` if set, else the
system's temporary directory: the test suite points it at pytest's temporary directory, which pytest prunes);
``Server.stop()`` sends SIGTERM to the server (SIGKILL to its process group after ``timeout`` seconds).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass


LOG_DIR_ENV = "PSD_SERVER_LOG_DIR"  # where the servers' logs go (module docstring)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    log: str  # the server's stdout and stderr

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM the server (its main process, as an orchestrator stops a container: vLLM then stops its engine
        processes itself, draining the requests in flight under ``--shutdown-timeout``); returns its exit code.
        Past ``timeout`` the whole process group gets SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # anything of the group still alive after the main process exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode


def log_file():
    """A new server log file, in ``$PSD_SERVER_LOG_DIR`` if set (module docstring)."""
    return tempfile.NamedTemporaryFile("w+", prefix="psd-server-", suffix=".log", delete=False,
                                       dir=os.environ.get(LOG_DIR_ENV) or None)


def start(args: list[str], *, plain: bool = False, env: dict | None = None, timeout: float = 300,
          cwd: str | None = None) -> Server:
    """A healthy server with ``args`` (vLLM server options; ``psd serve`` conventions unless ``plain``). ``cwd``:
    the directory it runs in (a checkout there is the plugin it imports: an earlier tree, for a before/after
    measurement)."""
    port = free_port()
    cmd = ([sys.executable, "-m", "vllm.entrypoints.openai.api_server"] if plain
           else [sys.executable, "-m", "psd_plugin.cli", "serve"])
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    log = log_file()
    proc = subprocess.Popen([*cmd, *args, "--host", "127.0.0.1", "--port", str(port)], env=full_env,
                            start_new_session=True, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return Server(proc, url, log.name)
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {open(log.name).read()[-3000:]}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"server did not become healthy in {timeout:.0f} s")
        time.sleep(1)
