"""Content (approximate) reuse at start-up and per request: whether this model can have it (its RoPE
re-rotates, the self-check passes), the ContentReuse the engine gets (connector.py), and the checks
of a server's --reuse and of a request's reuse options against what is available."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from kvserve.config_slices import ReuseConfig
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.kernels import cpu_ext
from kvserve.kvcache.kv_storage import LayerKV
from kvserve.kvcache.manager import KVCacheManager
from kvserve.kvcache.piece_index import PieceIndex
from kvserve.kvcache.pieces import line_end_ids
from kvserve.request import REUSE_OPTION_NAMES, ReuseOptions
from kvserve.reuse.audit import Auditor
from kvserve.reuse.connector import ContentReuse
from kvserve.reuse.cost import CostModel
from kvserve.reuse.matcher import ContentMatcher
from kvserve.reuse.repairer import Repairer

if TYPE_CHECKING:
    from kvserve.tokenizer import Tokenizer

log = logging.getLogger("kvserve.engine")

# model families whose decoder is embed -> layers(hidden, position_embeddings) -> norm, so the
# repair forward can drive the layers itself
CONTENT_REUSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_content_reuse(model: Any) -> tuple[Any, str]:
    """(RopeRotator, "") when approximate reuse is possible on this model, else (None, reason).
    Runs the start-up self-check: moved K must equal K computed at the new positions."""
    from kvserve.errors import UnsupportedModelError
    from kvserve.kvcache.rope import RopeRotator, self_check
    from kvserve.models.hf_adapter import sliding_window

    if sliding_window(model.config):
        return None, (
            "the model has sliding-window layers: approximate reuse is declined on them (the repair "
            "forward and its attention probes run full-attention rows only, and a chunk moved into a "
            "window would need its KV recomputed against the new window anyway)"
        )
    model_type = getattr(model.config, "model_type", "")
    if model_type not in CONTENT_REUSE_MODEL_TYPES:
        return None, f"model type {model_type!r} is not supported for approximate reuse"
    try:
        rotator = RopeRotator.from_model(model)
    except UnsupportedModelError as e:
        return None, e.message
    ok, detail = self_check(model, rotator)
    if not ok:
        return None, f"RoPE self-check failed ({detail})"
    log.info("RoPE self-check passed: %s", detail)
    return rotator, ""


def build_content_reuse(
    config: ReuseConfig,
    model_name: str,
    chunk_size: int,
    max_num_batched_tokens: int,
    model: Any,
    tokenizer: Tokenizer,
    layers: list[LayerKV],
    device: torch.device,
    kv: KVCacheManager,
    cost: CostModel,
    seed: int,
) -> ContentReuse:
    """Content reuse for this model: the matcher (always: it reports why content reuse is off) and,
    where the model's RoPE can be re-rotated, the repairer that moves matched KV in."""
    rotator, reason = check_content_reuse(model)
    if rotator is not None and device.type == "cpu":
        rotator.ext = cpu_ext.load_or_none()  # moved keys rotated in one call a layer (bitwise the same)
    matcher = ContentMatcher(
        config,
        model_name,
        chunk_size,
        max_num_batched_tokens,
        PieceIndex(kv.store),
        cost,
        rotator is not None,
        reason,
        lambda: line_end_ids(tokenizer.token_texts()),
    )
    if config.reuse == "any" and rotator is not None:
        _ = matcher.cutter  # every request is cut: find the line ends now, not in the first one's TTFT
    repairer = Repairer(layers, rotator, device, kv) if rotator else None
    require_content_reuse(config.reuse, rotator, reason)
    if config.reuse == "any" and config.recompute_strategy == "auto":
        auto = matcher.auto_preset()
        if isinstance(auto, str):
            log.warning(
                "--reuse any on %s: content matches are served exactly (%s; docs/blend.md); name a "
                "repair (--recompute-strategy, or a request's recompute_strategy) to opt into its "
                "measured loss",
                model_name,
                auto,
            )
        else:
            log.info("--reuse any: content matches are repaired with %s", auto.describe())
    auditor = Auditor(
        config.audit_rate, config.audit_max_kl, seed, config.audit_tokens, config.audit_requests_per_minute
    )
    return ContentReuse(matcher, repairer, auditor)


def require_content_reuse(reuse: str, rotator: Any, reason: str) -> None:
    """Start-up: a server whose default is `--reuse any` must be able to honour it (ConfigError)."""
    if reuse == "any" and rotator is None:
        raise ConfigError(
            f"--reuse any needs approximate reuse, which is unavailable here: {reason}; "
            "start with --reuse prefix (exact prefix reuse only)",
            param="reuse",
        )


def check_reuse_request(
    options: ReuseOptions | None, available: bool, reason: str, default_reuse: str = "prefix"
) -> None:
    """Per request: reuse='any' where approximate reuse is unavailable is a 400 naming `reuse`, never
    a silently prefix-only answer; so is a repair or audit option on a request served with exact
    reuse only (it would do nothing)."""
    if options is None:
        return
    if options.reuse == "any" and not available:
        raise InvalidRequestError(
            f"reuse='any' (approximate reuse) is unavailable on this server: {reason}; "
            "send reuse='prefix' or leave it out",
            param="reuse",
        )
    if (options.reuse or default_reuse) != "any":
        for name in REUSE_OPTION_NAMES:
            if name != "reuse" and getattr(options, name) is not None:
                raise InvalidRequestError(
                    f"{name} applies to approximate reuse, and this request is served with exact "
                    "prefix reuse only: also send reuse='any', or leave it out",
                    param=name,
                )
