"""Which KV codec a bit budget gets: chosen by the answers each codec keeps, per byte (issue 38).

`--kv-cache-bits N` and the cold tier's default codec (`--kv-cold-codec auto`) pick, among the codecs
of N bits that the serving model's head_dim can pack (a nominal width of at most N and more than the
next smaller budget: 4 bits is int4, nvfp4, mxfp4, turbo4 and turbo3.5; a user asking for 8 bits is not
served 4; the cold tier takes any width under 16),
the one with the most capacity whose measured task accuracy is at least TARGET x bf16's on every
measured model and task family (answers kept over the SCORED measures' prompts; generated documents
and real documentation text are judged apart, as two models would be). The codecs compared are judged on
the same prompts: a budget compares only those of its codecs run on every measure any of them was run
on, per model (`best_measured`; a codec lacking one waits for its run), and if none is, all of them on
the measures they share. Where none meets the target, the best measured one within the budget is
picked and its loss said (CodecChoice.meets False). A K/V codec's width is
the mean of its two halves (kint3-vturbo3 is a 3-bit codec). Capacity is the codec's tokens per byte
against bf16 at the model's head count and head_dim (metadata included), so it is computed, not
measured.

The accuracies live in codec_accuracy.json beside this file, written by the task benchmark (never by
hand): `scripts/bench_reuse_quality.py --codecs bf16,... --registry kvserve/quant/codec_accuracy.json`
records, per model and measure (a real-text run under "lookup.real"), each codec's accuracy relative to the run's first codec (bf16), with
the run's prompts, machine, block size and command. A codec with no measurement is never picked by a
budget; a codec with a KIVI K (one scale and zero per block) counts as measured only at the block size
it was measured at.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvserve.errors import ConfigError
from kvserve.quant.registry import CODEC_NAMES, MIXED_KV, head_dim_problem, make_codec

TARGET = 0.97  # x bf16's task accuracy, on every measured model and task family
# The measures a codec is chosen by: those scored against the documents' answers. Free form is scored
# by its likeness to bf16's own text, which any change of wording lowers; it is reported, not chosen by.
SCORED = ("lookup", "multihop")
# Each measure on two task families (issue 64): generated documents under the measure's name
# ("lookup"), real documentation text under the name with this suffix ("lookup.real"). A family is
# judged on its own, as if it were another model: a codec must keep TARGET on each.
REAL = ".real"
REAL_LABEL = " (real text)"  # the real family's key in accuracy dicts: "smollm2-135m (real text)"
ACCURACY_FILE = Path(__file__).with_name("codec_accuracy.json")
BUDGETS = (16, 8, 4, 3, 2)  # the values --kv-cache-bits takes

# The quantizer's width in bits per value, scales and norms aside: what a bit budget is compared with.
WIDTH = {
    "fp32": 32.0,
    "fp16": 16.0,
    "bf16": 16.0,
    "int8": 8.0,
    "fp8_e4m3": 8.0,
    "int4": 4.0,
    "int4dq": 4.0,
    "nvfp4": 4.0,
    "mxfp4": 4.0,
    "turbo4": 4.0,
    "turbo3.5": 3.5,
    "int3": 3.0,
    "int3dq": 3.0,
    "turbo3": 3.0,
    "turbo2.5": 2.5,
    "int2": 2.0,
    "int2dq": 2.0,
    "turbo2": 2.0,
}
WIDTH.update({name: (WIDTH[k] + WIDTH[v]) / 2 for name, (k, v) in MIXED_KV.items()})  # K's and V's mean
assert set(WIDTH) == set(CODEC_NAMES), "every codec needs a nominal width"


@dataclass(frozen=True)
class CodecChoice:
    codec: str
    budget: int | None  # --kv-cache-bits, or None: named by the user, or the cold tier's pick
    role: str  # what chose it, for the log: "--kv-cache-bits 4", "--kv-cache-dtype turbo3", "the cold tier"
    capacity: float  # tokens per byte against bf16, this model's layout, metadata included
    accuracy: dict[str, float]  # model -> task accuracy x bf16 (measured_accuracy)
    measures: Mapping[str, frozenset[str]]  # model -> the SCORED measures `accuracy` pools

    @property
    def worst(self) -> float:
        return min(self.accuracy.values())

    @property
    def meets(self) -> bool:
        """At least TARGET on every measured model and task family."""
        return self.worst >= TARGET

    def describe(self) -> str:
        """One line for the start-up log: the codec, its figures, and whether it keeps the answers."""
        figures = ", ".join(
            f"{m} {a:.3f}x ({' + '.join(sorted(self.measures[m]))})" for m, a in sorted(self.accuracy.items())
        )
        line = (
            f"{self.role}: {self.codec}, {self.capacity:.2f}x bf16's tokens per byte; "
            f"task accuracy (answers kept) against bf16 KV: {figures}"
        )
        if self.meets:
            return f"{line} (meets {TARGET}x)"
        if self.budget is None:
            return f"{line}: it loses {1 - self.worst:.0%} of bf16's answers (below {TARGET}x)"
        return (
            f"{line}: NO codec within {self.budget} bits keeps {TARGET}x bf16's answers; this is the best "
            f"measured one and loses {1 - self.worst:.0%} of them. Use a larger --kv-cache-bits to keep them"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "codec": self.codec,
            "budget_bits": self.budget,
            "capacity_x_bf16": round(self.capacity, 3),
            "task_accuracy_x_bf16": self.accuracy,
            "measures": {m: sorted(runs) for m, runs in sorted(self.measures.items())},
            "target": TARGET,
            "meets_target": self.meets,
            "source": measurement_source(),
        }


@cache
def _measurements() -> dict:
    with open(ACCURACY_FILE) as f:
        return json.load(f)


@cache
def block_size_matters(codec: str) -> bool:
    """Whether `codec`'s accuracy depends on the block size: its K is a block codec (KIVI's per-channel
    K takes one scale and zero per block, and a wider group costs answers: docs/kv-quality.md)."""
    return not make_codec(codec, 1, 64).k.per_token


def measured_on(codec: str, block_size: int = 16) -> dict[str, frozenset[str]]:
    """Model (and family: "m" generated, "m (real text)") -> the SCORED measures' keys `codec` has a
    run of (at `block_size`, for a codec whose accuracy depends on it)."""
    any_block_size = not block_size_matters(codec)
    out = {}
    for model, measures in _measurements()["models"].items():
        for suffix, label in (("", model), (REAL, model + REAL_LABEL)):
            runs = frozenset(
                key
                for key in (m + suffix for m in SCORED)
                if codec in measures.get(key, {}).get("accuracy", {})
                and (any_block_size or measures[key].get("block_size", 16) == block_size)
            )
            if runs:
                out[label] = runs
    return out


def measured_accuracy(
    codec: str, block_size: int = 16, only: Mapping[str, frozenset[str]] | None = None
) -> dict[str, float]:
    """Model -> task accuracy of `codec` relative to bf16 KV: the answers it kept over every prompt of
    the SCORED measures it was run on (or of those `only` names for the model), against the answers
    bf16 KV kept on those prompts (pooled, so a measure counts by its prompts and a low-scoring
    measure's few answers do not decide alone); empty: never measured (at `block_size`, for a codec
    whose accuracy depends on it)."""
    out = {}
    for label, runs in measured_on(codec, block_size).items():
        model = label.removesuffix(REAL_LABEL)
        kept = reference = 0.0
        for measure in sorted(runs if only is None else runs & only.get(label, frozenset())):
            run = _measurements()["models"][model][measure]
            kept += run["accuracy"][codec] * run["prompts"]
            reference += run["accuracy"][run["reference"]] * run["prompts"]
        if reference > 0:
            out[label] = kept / reference
    return out


def best_measured(codecs: list[str], block_size: int) -> list[str]:
    """Those of `codecs` run on every SCORED measure any of them was run on, on every model (the
    codecs a budget compares, so that each is judged on the same prompts as the others); all of
    them when none is."""
    full: dict[str, frozenset[str]] = {}
    for codec in codecs:
        for model, runs in measured_on(codec, block_size).items():
            full[model] = full.get(model, frozenset()) | runs
    complete = [c for c in codecs if measured_on(c, block_size) == full]
    return complete or codecs


def common_measures(codecs: list[str], block_size: int) -> dict[str, frozenset[str]]:
    """Model -> the SCORED measures every one of `codecs` measured on that model has: codecs compared
    with each other are compared on the same prompts (one measured on lookup only is not set beside
    another pooled over lookup and multi-hop)."""
    common: dict[str, frozenset[str]] = {}
    for codec in codecs:
        for model, runs in measured_on(codec, block_size).items():
            common[model] = common.get(model, runs) & runs
    return common


def measurement_source() -> str:
    runs = [
        f"{model}: {m['prompts']} {measure} prompts ({m['source']})"
        for model, measures in sorted(_measurements()["models"].items())
        for measure, m in sorted(measures.items())
    ]
    return "; ".join(runs)


def capacity(codec: str, num_kv_heads: int, head_dim: int, block_size: int) -> float:
    """Tokens per byte against bf16 for this layout (stored bits per value, metadata included)."""
    return 16.0 / make_codec(codec, num_kv_heads, head_dim).bits_per_element(block_size)


def codec_quality(
    codec: str, num_kv_heads: int, head_dim: int, block_size: int, role: str
) -> CodecChoice | None:
    """The measured figures of a codec the user named (None: not measured)."""
    accuracy = measured_accuracy(codec, block_size)
    if not accuracy:
        return None
    cap = capacity(codec, num_kv_heads, head_dim, block_size)
    return CodecChoice(codec, None, role, cap, accuracy, measured_on(codec, block_size))


def budget_codecs(budget: int | None, head_dim: int, block_size: int) -> list[str]:
    """The measured codecs a budget chooses among on this head_dim: a nominal width of at most
    `budget` bits and more than the next smaller budget (None: the cold tier, any width under 16)."""
    if budget is not None and budget not in BUDGETS:
        raise ConfigError(
            f"kv_cache_bits must be one of {list(BUDGETS)} (or 0), got {budget}", param="kv_cache_bits"
        )
    if budget is None:  # the cold tier exists to hold more: a full-width codec is never its choice
        low, high = 0.0, 15.0
    else:
        low, high = float(max([b for b in BUDGETS if b < budget], default=0)), float(budget)
    return [
        name
        for name in CODEC_NAMES
        if low < WIDTH[name] <= high
        and head_dim_problem(name, head_dim) is None
        and measured_on(name, block_size)
    ]


def choose_codec(budget: int | None, num_kv_heads: int, head_dim: int, block_size: int) -> CodecChoice:
    """The measured codec a budget gets (None: no bit limit, the cold tier) on this model's layout."""
    names = best_measured(budget_codecs(budget, head_dim, block_size), block_size)
    role = "the cold tier" if budget is None else f"--kv-cache-bits {budget}"
    common = common_measures(names, block_size)
    candidates = []
    for name in names:
        accuracy = measured_accuracy(name, block_size, common)
        if accuracy:
            cap = capacity(name, num_kv_heads, head_dim, block_size)
            measures = {m: common[m] for m in accuracy}
            candidates.append(CodecChoice(name, budget, role, cap, accuracy, measures))
    if not candidates:
        raise ConfigError(
            f"no measured KV codec fits {budget} bits with head_dim {head_dim}; name one with --kv-cache-dtype",
            param="kv_cache_bits",
        )
    passing = [c for c in candidates if c.meets]
    if passing:  # the most tokens per byte among those that keep the answers; then the better one
        return max(passing, key=lambda c: (round(c.capacity, 6), c.worst))
    return max(candidates, key=lambda c: (c.worst, c.capacity))  # none keeps them: lose the fewest
