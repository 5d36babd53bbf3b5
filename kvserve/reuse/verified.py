"""Which approximate-reuse repair keeps the answers on which model: the `auto` strategy's table, read
from data.

`--recompute-strategy auto` (the default) repairs content matches with the preset verified on the
served model, and serves them exactly (declined: DECLINED_UNVERIFIED) on a model with none. The
verified presets are a JSON file written by `scripts/bench_reuse_quality.py --verify MODEL`, never by
hand: the package's own (verified_presets.json beside this module) unless `--verified-presets PATH`
names another, so a user can verify their own model. A model's entry is

    {"verified": true | false,            # false: measured and it missed (listed, never used)
     "preset": {"name": "query R=4 0.45", "recompute_strategy": "query", "recompute_tokens": 4, ...},
     "pieces": "content",                 # the --pieces it was measured with: auto needs the same
     "audit_agreement": 0.93,             # the online audit's greedy agreement on the verified run
     "figures": {"real": {"lookup": {"x_full": ..., "ttft_x_full": ..., "n": ...}, ...}, "generated": {...}},
     "limits": "...",                     # missed: what keeps it from the targets
     "pareto": {...}, "candidates": {...}, "targets": {...}, "machine": "...",
     "source": "the command", "data": ["docs/data/...json", ...]}   # the runs it was judged on

A preset is verified on a model when, on every task family (generated and real text), each measure
of TARGETS keeps at least its share of full prefill's answers at a TTFT p50 of at most its share of
full prefill's (`meets`). A user who names a strategy (server flag or request field) opts into its
measured loss instead.

A verified preset is watched while it serves (AutoWatch): the online audit's greedy agreement on the
prompts `auto` repaired is compared with the verification's, and `auto` falls back to exact serving
for the rest of the process once the audits fall clearly below it (logged, and in /v1/stats).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.errors import ConfigError
from kvserve.request import ReuseOptions

log = logging.getLogger(__name__)

PRESETS_FILE = Path(__file__).with_name("verified_presets.json")
# how a plan repaired with auto's preset names its source (ReusePlan.preset): the audits the watch
# judges are those of plans whose source starts with it
AUTO_SOURCE = "auto: "
# the ReuseOptions fields a preset may set (a preset never sets `reuse` or `audit`)
PRESET_FIELDS = (
    "recompute_strategy",
    "recompute_tokens",
    "recompute_ratio",
    "blend_check_layer",
    "blend_seam_tokens",
)
FAMILIES = ("generated", "real")  # the task families a preset must hold on


@dataclass(frozen=True)
class Targets:
    """What a preset must keep, per measure, as a share of full prefill's answers, and how fast."""

    accuracy: dict[str, float]  # measure -> min accuracy x full prefill
    ttft: float  # max TTFT p50 x full prefill's (every measure)


# issue 64: the larger model is held to more, as the papers' 96-101 % are on 7B+ models
DEFAULT_TARGETS = Targets({"lookup": 0.97, "multihop": 0.97, "recall": 0.95}, 0.5)
TARGETS = {"qwen2.5-coder-1.5b": Targets({"lookup": 0.99, "multihop": 0.99, "recall": 0.97}, 0.4)}


def targets_for(model: str) -> Targets:
    return TARGETS.get(model, DEFAULT_TARGETS)


def shortfalls(targets: Targets, figures: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """What keeps measured figures (family -> measure -> {"x_full", "ttft_x_full"}) from the targets,
    one line each; empty: they meet them. A family or measure not measured is a shortfall."""
    out = []
    for family in FAMILIES:
        measured = figures.get(family, {})
        for measure, least in targets.accuracy.items():
            f = measured.get(measure)
            if f is None:
                out.append(f"{family} {measure}: not measured")
                continue
            x = f["x_full"]
            if not x >= least:  # NaN (full prefill answered none) is no evidence either
                out.append(f"{family} {measure}: {x:.3f}x full prefill's answers < {least}x")
            if not f["ttft_x_full"] <= targets.ttft:
                out.append(
                    f"{family} {measure}: TTFT p50 {f['ttft_x_full']:.2f}x full prefill's > {targets.ttft}x"
                )
    return out


@dataclass(frozen=True)
class VerifiedPreset:
    model: str
    name: str  # as the benchmark names it: "query R=4 0.45"
    options: ReuseOptions  # the repair fields it sets
    pieces: str
    audit_agreement: float  # the verification's online-audit greedy agreement
    source: str  # the command and data file that verified it

    def describe(self) -> str:
        return f"{self.name}, verified on {self.model} ({self.source})"


def parse_entry(model: str, entry: dict[str, Any]) -> VerifiedPreset:
    """One model's verified entry; a malformed one is a ConfigError naming the field."""
    try:
        preset = entry["preset"]
        unknown = set(preset) - {"name", *PRESET_FIELDS}
        if unknown:
            raise ConfigError(f"verified preset for {model}: unknown fields {sorted(unknown)}")
        options = ReuseOptions(**{k: preset[k] for k in PRESET_FIELDS if k in preset})
        if not 0.0 <= float(entry["audit_agreement"]) <= 1.0:
            raise ConfigError(f"verified preset for {model}: audit_agreement must be in [0, 1]")
        return VerifiedPreset(
            model=model,
            name=str(preset["name"]),
            options=options,
            pieces=str(entry["pieces"]),
            audit_agreement=float(entry["audit_agreement"]),
            source=f"{entry['source']}; data {', '.join(entry['data'])}",
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"verified preset for {model} is malformed ({type(e).__name__}: {e})") from e


def load(path: str = "") -> dict[str, dict[str, Any]]:
    """Model -> its entry (verified or missed) in the presets file (`path`, or the package's), read
    afresh: once per engine built."""
    file = Path(path) if path else PRESETS_FILE
    try:
        with open(file) as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise ConfigError(
            f"--verified-presets {file}: no such file (write one with "
            "scripts/bench_reuse_quality.py --verify MODEL)"
        ) from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"--verified-presets {file} is not JSON: {e}") from e
    models = data.get("models")
    if not isinstance(models, dict):
        raise ConfigError(f"--verified-presets {file} has no 'models' table")
    return models


def verified_preset(model: str, path: str = "") -> VerifiedPreset | None:
    """The preset verified on `model` (None: none was, or it was measured and missed)."""
    entry = load(path).get(model)
    if entry is None or not entry.get("verified"):
        return None
    return parse_entry(model, entry)


# --- the online watch ----------------------------------------------------------------------------
WATCH_MIN_AUDITS = 20  # audits of auto-repaired prompts before the watch judges
WATCH_WINDOW = 200  # the latest audits it judges by
WATCH_Z = 2.33  # one-sided 99 %: falls back only when the audits are clearly below the verification's


@dataclass
class AutoWatch:
    """The online audits of prompts `auto` repaired, against the verification's agreement."""

    preset: VerifiedPreset | None
    agreements: list[float] = field(default_factory=list)  # per audited prompt, the latest WATCH_WINDOW
    fell_back: str = ""  # why auto serves exactly now ("" while it repairs)

    def observe(self, agreement: float) -> bool:
        """One audit of an auto-repaired prompt; True when it makes auto fall back (once)."""
        if self.preset is None or self.fell_back:
            return False
        self.agreements.append(agreement)
        del self.agreements[:-WATCH_WINDOW]
        n = len(self.agreements)
        if n < WATCH_MIN_AUDITS:
            return False
        mean = statistics.fmean(self.agreements)
        spread = statistics.stdev(self.agreements) if n > 1 else 0.0
        upper = mean + WATCH_Z * spread / math.sqrt(n)
        if upper >= self.preset.audit_agreement:
            return False
        self.fell_back = (
            f"audits of {n} served prompts agree {mean:.3f} with full prefill (99 % bound {upper:.3f}), "
            f"below the verification's {self.preset.audit_agreement:.3f}"
        )
        log.warning(
            "--recompute-strategy auto: %s falls back to exact serving: %s", self.preset.name, self.fell_back
        )
        return True

    def active(self) -> VerifiedPreset | None:
        return None if self.fell_back else self.preset

    def stats(self) -> dict[str, Any]:
        p = self.preset
        return {
            "preset": p.name if p is not None else None,
            "source": p.source if p is not None else None,
            "verified_agreement": p.audit_agreement if p is not None else None,
            "num_audits": len(self.agreements),
            "audited_agreement": statistics.fmean(self.agreements) if self.agreements else None,
            "fell_back": self.fell_back or None,
        }
