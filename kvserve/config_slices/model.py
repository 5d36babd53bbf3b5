"""ModelConfig: the model, where it runs and in what precision (a slice of ServeConfig, kvserve/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config_slices.choices import choose
from kvserve.errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(
        default="smollm2-135m",
        metadata={
            "help": "builtin name (smollm2-135m, tiny-random-llama, random:llama-3.1-8b), a local HF directory or a .gguf file"
        },
    )
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (on CPU bfloat16 where AMX or AVX-512 BF16 make it measurably faster, else float32; bfloat16 on GPUs of compute capability 8.0+, else float16), float32, bfloat16 or float16"
        },
    )
    weight_precision: str = field(
        default="dense",
        metadata={
            "help": "dense (the weights as --dtype), or NestedFP weights held once as FP16 in two byte "
            "planes (2 bytes a parameter, fp32 activations; CPU, fused forward): fp16 (exact FP16 "
            "weights), fp8 (the upper plane alone, an E4M3 view: half the bytes read, about 2.7 percent "
            "weight error, projection inputs rounded to bf16) or auto (fp8 steps while load puts --slo-ttft-ms or --fp8-queue-depth "
            "at risk, fp16 otherwise, with hysteresis)"
        },
    )
    slo_ttft_ms: float = field(
        default=0.0,
        metadata={
            "help": "weight_precision auto: steps compute at fp8 while the recent time-to-first-token "
            "p90 is over this (0 = judge by queue depth alone)"
        },
    )
    fp8_queue_depth: int = field(
        default=4,
        metadata={
            "help": "weight_precision auto: steps compute at fp8 while this many or more requests wait to be "
            "scheduled; back to fp16 at half of it"
        },
    )
    precision_hold_s: float = field(
        default=2.0,
        metadata={"help": "weight_precision auto: stay at least this long in fp8 before going back to fp16"},
    )
    max_model_len: int = field(
        default=0, metadata={"help": "context length in tokens; 0 = the model's max_position_embeddings"}
    )
    seed: int = field(default=0, metadata={"help": "seed for requests that give no seed"})
    attention_backend: str = field(
        default="auto", metadata={"help": "auto, reference, cpu_paged, triton or cuda"}
    )
    model_forward: str = field(
        default="auto",
        metadata={
            "help": "auto (the fused CPU forward for Llama-family models where the CPU extension runs, else "
            "Hugging Face's modeling code) or hf (always the modeling code, the reference)"
        },
    )

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix."""
        choose(self, "device", ("auto", "cpu", "cuda"))
        choose(self, "dtype", ("auto", "float32", "bfloat16", "float16"))
        choose(self, "weight_precision", ("dense", "fp16", "fp8", "auto"))
        choose(self, "attention_backend", ("auto", "reference", "cpu_paged", "triton", "cuda"))
        choose(self, "model_forward", ("auto", "hf"))
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len must be >= 0 (got {self.max_model_len})")
        if self.slo_ttft_ms < 0 or self.fp8_queue_depth < 1 or self.precision_hold_s < 0:
            raise ConfigError("slo_ttft_ms and precision_hold_s must be >= 0 and fp8_queue_depth >= 1")
        if self.weight_precision != "dense" and self.dtype not in ("auto", "float32"):
            raise ConfigError(
                f"weight_precision {self.weight_precision} computes in float32 over NestedFP weights; "
                f"drop --dtype {self.dtype} (or use --weight-precision dense)"
            )
        if self.weight_precision != "dense" and self.model_forward == "hf":
            raise ConfigError(
                "weight_precision fp16 / fp8 / auto run through the fused CPU forward; drop --model-forward hf "
                "(or use --weight-precision dense)"
            )
