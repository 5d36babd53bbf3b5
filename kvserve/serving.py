"""The composition root: the one place a serving process is assembled (Engine -> AsyncEngine ->
LocalBackend, with its metrics), for `kvserve serve` (cli.py) and each cluster replica
(cluster/replica.py). The offline LLM API (llm.py) drives an Engine directly and is not a server.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

from kvserve.api.backend import LocalBackend
from kvserve.config import ServeConfig


def describe(config: ServeConfig, info: Any) -> str:
    """The start-up summary: what was chosen."""
    pool_bytes = int(info.pool_tokens * info.bytes_per_token)
    return "\n".join(
        [
            f"kvserve: model {config.model} ({info.model_path})",
            f"  device {info.device}, dtype {info.dtype}, attention backend {info.attention_backend}",
            f"  model forward {info.model_forward}",
            f"  KV codec {info.kv_codec}: {info.bytes_per_token:g} bytes/token "
            f"({info.num_layers} layers x {info.num_kv_heads} KV heads x {info.head_dim})",
            f"  KV pool {info.num_blocks} blocks x {info.block_size} = {info.pool_tokens} tokens, "
            f"{pool_bytes / 2**20:.1f} MiB (budget {config.max_cache_bytes / 2**20:.1f} MiB)",
            *_decoded_line(config, info),
            f"  KV layout: {info.kv_layout}",
            f"  context {info.max_model_len} tokens, chunk {config.chunk_size} tokens, "
            f"prefix caching {'on' if config.enable_prefix_caching else 'off'}",
        ]
    )


def _decoded_line(config: ServeConfig, info: Any) -> list[str]:
    """What --kv-decoded-bytes became: kept decoded blocks, or why none."""
    if not config.kv_decoded_bytes:
        return []
    if not info.kv_decoded_bytes:
        return [
            f"  kv_decoded_bytes unused: the {info.kv_codec} pool holds values attention reads as they are"
        ]
    return [
        f"  decoded blocks kept across steps: up to {info.kv_decoded_bytes / 2**20:.1f} MiB of the budget "
        "(for kernels that cannot read the codec in place)"
    ]


def warm_up(engine: Any, texts: Sequence[str]) -> None:
    """Compute and pin `texts` before serving (drives the engine directly: the worker is not started)."""
    from tqdm import tqdm

    from kvserve.llm import warm

    for i, text in enumerate(tqdm(texts, desc="warm-up", unit="prefix", disable=not texts)):
        warm(engine, f"startup-warm-{i}", engine.tokenizer.encode_prompt(text), pin=True)


def start_backend(config: ServeConfig, banner: str = "") -> LocalBackend:
    """Build the engine (printing `banner` and the start-up summary), warm its prefixes, start its
    worker thread, and return the backend the HTTP app or a replica serves from."""
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.engine import Engine
    from kvserve.metrics import Metrics

    engine = Engine(config)
    print(f"{banner}{describe(config, engine.info)}", flush=True)
    warm_up(engine, config.warm)
    metrics = Metrics(config.served_model_name or config.model, engine.info.max_model_len)
    async_engine = AsyncEngine(
        engine, config.max_queue_size, observer=metrics.observe, max_queue_share=config.max_queue_share
    )
    async_engine.start()
    return LocalBackend(async_engine, metrics, config)


def freeze_startup_heap() -> int:
    """Collect, then move every object the start-up made (the model, torch's and transformers'
    modules: ~480,000 objects) out of the cyclic garbage collector's reach, and return how many.
    Until then every full collection walked them all: a 0.4 s pause of the whole server (every
    stream, /health) that any burst of allocation could set off, such as five 400 KB schemas
    parsed at once (docs/reliability.md). Only for a serving process: what is frozen is never
    collected, so a process that builds and drops engines (the tests) must not call it."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
