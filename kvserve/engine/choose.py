"""What the engine runs on and in, chosen from the config and the hardware before anything is built:
the device, the compute dtype (on CPU by the bf16 units and a short timing), the KV codec of the pool
and of the cold tier (by measured task accuracy, quant/choice.py)."""

from __future__ import annotations

import functools
import logging
import math
import os
import time

import torch

from kvserve.config import ServeConfig
from kvserve.errors import ConfigError
from kvserve.quant.choice import CodecChoice, choose_codec, codec_quality
from kvserve.quant.registry import CODEC_NAMES

log = logging.getLogger("kvserve.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = (
            "this torch build has no CUDA support"
            if torch.version.cuda is None
            else "no CUDA device is visible"
        )
        raise ConfigError(f"device cuda requested but {why}; use --device cpu", param="device")
    return torch.device(name)


# How `--dtype auto` resolves on CPU when set (float32 or bfloat16) instead of by the hardware: the test
# suite sets it so that its results do not depend on the CPU it runs on.
AUTO_CPU_DTYPE_ENV = "KVSERVE_AUTO_CPU_DTYPE"
TIMING_ROUNDS = 3  # choose_cpu_dtype: alternating rounds of the fp32 and bf16 linear timings


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: on CPU what the hardware computes fastest (choose_cpu_dtype); bfloat16 on GPUs that compute
    it natively (compute capability >= 8.0), else float16 (bfloat16 is emulated, slowly, before Ampere)."""
    if name == "auto":
        if device.type == "cpu":
            forced = os.environ.get(AUTO_CPU_DTYPE_ENV)
            if forced:
                if forced not in ("float32", "bfloat16"):
                    raise ConfigError(f"{AUTO_CPU_DTYPE_ENV} must be float32 or bfloat16, got {forced!r}")
                log.info("dtype auto -> %s (set by %s)", forced, AUTO_CPU_DTYPE_ENV)
                return DTYPES[forced]
            dtype, why = choose_cpu_dtype()
            log.info("dtype auto -> %s: %s (--dtype overrides)", str(dtype).replace("torch.", ""), why)
            return dtype
        return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16
    return DTYPES[name]


@functools.cache
def choose_cpu_dtype() -> tuple[torch.dtype, str]:
    """bfloat16 where the CPU has native bf16 units (AMX, AVX-512 BF16) and a short timing of the linear
    kernel the model will run confirms it is faster than float32 here (decode-like 8 rows and
    prefill-like 256 rows of a 576 x 1536 projection); float32 otherwise. Returns (dtype, why).

    The two are timed in alternating rounds, the best of each kept: a timing of one and then the other
    chose fp32 on an AMX CPU while a test suite shared its 2 cores (load that came and went between
    the two), and alternating lets such load weigh on both."""
    from kvserve.kernels.cpu_features import bf16_units

    units = bf16_units()
    if not units:
        return torch.float32, "this CPU has no native bf16 units (AMX or AVX-512 BF16)"
    from kvserve.kernels import cpu_ext

    times = {torch.float32: math.inf, torch.bfloat16: math.inf}
    for _ in range(TIMING_ROUNDS):
        for dtype in times:
            times[dtype] = min(times[dtype], _linear_seconds(dtype))
    ratio = times[torch.float32] / times[torch.bfloat16]
    ext = cpu_ext.load_or_none()
    path = f" ({cpu_ext.linear_path(ext, 576)})" if ext is not None else ""
    if ratio > 1.0:
        return torch.bfloat16, f"{units}; bf16 linear{path} measured {ratio:.1f}x faster than fp32"
    return torch.float32, f"{units}, but bf16 linear measured {1 / ratio:.1f}x slower than fp32 here"


def _linear_seconds(dtype: torch.dtype, in_features: int = 576, out_features: int = 1536) -> float:
    """Best-of-5 seconds of one decode-like (8 rows) plus one prefill-like (256 rows) linear, through the
    kernel wrap_linears would use (the CPU extension), else torch."""
    from kvserve.kernels import cpu_ext
    from kvserve.models.cpu_linear import RowInvariantLinear

    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.05)
    linear = linear.to(dtype)
    ext = cpu_ext.load_or_none()
    layer: torch.nn.Module = RowInvariantLinear(linear, ext) if ext is not None else linear
    xs = [torch.randn(rows, in_features, generator=gen).to(dtype) for rows in (8, 256)]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(6):
            t0 = time.perf_counter()
            for x in xs:
                layer(x)
            best = min(best, time.perf_counter() - t0)
    return best


def resolve_codec(
    config: ServeConfig, dtype: torch.dtype, num_kv_heads: int, head_dim: int
) -> tuple[str, CodecChoice | None]:
    """kv_cache_bits picks by measured task accuracy per byte (quant/choice.py); kv_cache_dtype names a
    codec; auto = the model dtype. With the codec, its measured task accuracy when it has one."""
    if config.kv_cache_bits:
        choice = choose_codec(config.kv_cache_bits, num_kv_heads, head_dim, config.block_size)
        (log.info if choice.meets else log.warning)("KV codec for %s", choice.describe())
        return choice.codec, choice
    if config.kv_cache_dtype == "auto":
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    else:
        name = config.kv_cache_dtype
    role = (
        "the model dtype (--kv-cache-dtype auto)"
        if config.kv_cache_dtype == "auto"
        else f"--kv-cache-dtype {name}"
    )
    quality = codec_quality(name, num_kv_heads, head_dim, config.block_size, role)
    if quality is not None and not quality.meets:  # a named lossy codec says its loss
        log.warning("KV codec for %s", quality.describe())
    return name, quality


def resolve_cold_codec(
    config: ServeConfig, num_kv_heads: int, head_dim: int
) -> tuple[str | None, CodecChoice | None]:
    """The cold tier's codec (None without a cold tier): named, or `auto`, the measured choice with no
    bit limit (quant/choice.py); with its measured task accuracy when it has one."""
    if not config.kv_cold_bytes:
        return None, None
    choice: CodecChoice | None
    if config.kv_cold_codec == "auto":
        choice = choose_codec(None, num_kv_heads, head_dim, config.block_size)
    else:
        if config.kv_cold_codec not in CODEC_NAMES:
            raise ConfigError(
                f"kv_cold_codec must be auto or a KV codec name ({', '.join(CODEC_NAMES)}); "
                f"got {config.kv_cold_codec!r}",
                param="kv_cold_codec",
            )
        name = config.kv_cold_codec
        choice = codec_quality(name, num_kv_heads, head_dim, config.block_size, f"the cold tier ({name})")
        if choice is None:
            return name, None
    (log.info if choice.meets else log.warning)("KV codec for %s", choice.describe())
    return choice.codec, choice


def nested_dtype(config: ServeConfig, device: torch.device) -> torch.dtype:
    """NestedFP weights compute in float32 on CPU (config.validate refuses other --dtype values)."""
    if device.type != "cpu":
        raise ConfigError(
            f"--weight-precision {config.weight_precision} is served on CPU only (the Triton NestedFP "
            "kernels are not wired into the engine); use --device cpu or --weight-precision dense",
            param="weight_precision",
        )
    return torch.float32
