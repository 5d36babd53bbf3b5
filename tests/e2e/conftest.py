"""Live-server fixtures: a real `kvserve` process on 127.0.0.1 and a free port, one per module."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
TINY = "tiny-random-llama"
# a small pool keeps start-up fast; tiny-random-llama stores 1 KiB per token
TINY_FLAGS = ("--model", TINY, "--max-cache-bytes", "64000000")


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    api_key: str = ""

    def client(self, api_key: str | None = None) -> OpenAI:
        key = api_key if api_key is not None else (self.api_key or "unused")
        return OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0)

    def http(self, **kwargs: object) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60, **kwargs)

    def stats(self) -> dict:
        with self.http() as h:
            r = h.get("/v1/stats")
            r.raise_for_status()
            return r.json()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(log_dir: Path, *flags: str, api_key: str = "", timeout_s: float = 120.0) -> Server:
    port = free_port()
    log_path = log_dir / f"kvserve-{port}.log"
    cmd = [sys.executable, "-m", "kvserve.cli", "--host", "127.0.0.1", "--port", str(port), *flags]
    if api_key:
        cmd += ["--api-key", api_key]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvserve exited with {proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(server)
    raise RuntimeError(f"kvserve did not become healthy in {timeout_s}s:\n{server.log()[-3000:]}")


def stop(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(5)


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


SMOLLM2 = "smollm2-135m"
# the real default model in fp32 (the suite pins --dtype auto to fp32 through KVSERVE_AUTO_CPU_DTYPE,
# which the server process inherits); 200 MB of pool holds ~4,000 tokens of fp32 KV
SMOLLM2_FLAGS = ("--model", SMOLLM2, "--max-cache-bytes", "200000000")


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One SmolLM2 server for every test module that needs real text (structured outputs, tools,
    prompt logprobs, real client libraries). Tests must not change its state in ways others see
    (pins: unpin what you warm)."""
    server = launch(tmp_path_factory.mktemp("kvserve-smollm2"), *SMOLLM2_FLAGS)
    yield server
    stop(server)


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = launch(tmp_path_factory.mktemp("kvserve"), *TINY_FLAGS)
    yield server
    stop(server)
