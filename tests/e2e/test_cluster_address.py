"""`kvserve cluster --address`: deploy onto a Ray cluster started beforehand (`ray start --head`),
serve, and on SIGTERM delete the application and leave that cluster running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import TINY, free_port, launch
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).parent / "ray")


def ray(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}
    return subprocess.run([RAY, *args], capture_output=True, text=True, timeout=120, env=env)


def test_deploys_onto_an_existing_ray_cluster_and_leaves_it_running(tmp_path: Path) -> None:
    ray("get-auth-token", "--generate")  # the token `ray start` uses (it enables token auth)
    port = free_port()
    started = ray("start", "--head", "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false")
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        with RedisServer() as redis:
            flags = ("cluster", "--address", f"127.0.0.1:{port}", "--replicas", "2", "--model", TINY)
            flags += ("--max-cache-bytes", "32000000", "--kv-redis-url", redis.url)
            server = launch(tmp_path, *flags, timeout_s=240)
            with server.http() as h:
                r = h.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 3})
                assert r.status_code == 200 and r.headers["x-kvserve-replica"]
                assert len(h.get("/v1/stats").json()["replicas"]) == 2
            server.proc.send_signal(signal.SIGTERM)
            assert server.proc.wait(90) == 0, server.log()[-3000:]
            assert "kvserve cluster: stopping" in server.log()
            with pytest.raises(httpx.HTTPError):  # the application is gone ...
                httpx.post(
                    server.base_url + "/v1/completions", json={"prompt": "x"}, timeout=5
                ).raise_for_status()
        status = ray("status", "--address", f"127.0.0.1:{port}")
        assert status.returncode == 0 and "0.0/2.0 CPU" in status.stdout, status.stdout + status.stderr
    finally:  # ... and the Ray cluster was still up until here
        ray("stop", "--force")
