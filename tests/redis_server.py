"""A real redis-server for tests: a subprocess on a free 127.0.0.1 port, no persistence, its own temp
directory. `kill()` and `start()` simulate a crash and a restart on the same port."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NOT_FOUND = (
    "redis-server not found: run `make setup` (it installs the Debian package redis-server) "
    "or apt-get install redis-server"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers_ping(port: int, timeout_s: float = 0.2) -> bool:
    """Whether a Redis server on `port` answers PING (a raw socket: no client library state)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """`redis-server` bound to 127.0.0.1 with `--save ""`, `--appendonly no`, `--maxmemory-policy
    allkeys-lru` and, when given, `--maxmemory`. Raises RuntimeError when the binary is missing."""

    def __init__(self, maxmemory: str | None = None, start_timeout_s: float = 5.0):
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(NOT_FOUND)
        self.binary = binary
        self.maxmemory = maxmemory
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="kvserve-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server (again, after `kill` or `stop`: the same port, an empty database) and
        wait until it answers PING."""
        assert self._proc is None, "already running"
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--maxmemory-policy", "allkeys-lru", "--dir", str(self.directory), "--logfile", "redis.log"]
        if self.maxmemory is not None:
            args += ["--maxmemory", self.maxmemory]
        with open(self.directory / "output.log", "ab") as output:  # the child keeps its own handle
            self._proc = subprocess.Popen(args, stdout=output, stderr=subprocess.STDOUT)
        deadline_s = time.monotonic() + self.start_timeout_s
        while not answers_ping(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline_s:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {self._log_tail()}")
            time.sleep(0.02)

    def flush(self) -> None:
        """FLUSHALL: an empty database, the server still up."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"FLUSHALL\r\n")
            assert s.recv(16).startswith(b"+OK"), "FLUSHALL failed"

    def kill(self) -> None:
        """SIGKILL: a crash. The data is gone (no persistence)."""
        self._end(signal.SIGKILL)

    def stop(self) -> None:
        self._end(signal.SIGTERM)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _end(self, sig: signal.Signals) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _log_tail(self) -> str:
        files = [self.directory / "output.log", self.directory / "redis.log"]
        text = "".join(f.read_text(errors="replace") for f in files if f.exists())
        return text[-2000:] or "(no output)"
