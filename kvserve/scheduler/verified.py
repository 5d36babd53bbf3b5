"""Which approximate-reuse repair keeps the answers on which model: the `auto` strategy's table.

`--recompute-strategy auto` (the default) repairs content matches with the preset listed here for the
served model, and serves them exactly (declined: DECLINED_UNVERIFIED) on a model with none. A preset
is listed only after `scripts/bench_reuse_quality.py` measured it on that model, at least 200 prompts
per measure, within the targets of docs/blend.md: lookup accuracy >= 0.97x full prefill,
multi-hop and free form >= 0.95x, TTFT p50 <= 0.5x. A user who names a strategy (server flag or
request field) opts into its measured loss instead.

No (model, preset) pair has met the targets yet (docs/blend.md, "Task accuracy"), so the table is
empty and `auto` serves every content match exactly.
"""

from __future__ import annotations

from kvserve.request import ReuseOptions

# model name (ServeConfig.model) -> the repair preset that met the targets on it
VERIFIED: dict[str, ReuseOptions] = {}


def verified_preset(model: str) -> ReuseOptions | None:
    return VERIFIED.get(model)
