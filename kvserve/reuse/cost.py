"""What a forward costs, in seconds, from what it computes: the basis of cost-aware reuse plans.

A step is counted as work units (`Work`):
  steps    forward passes: the per-step part (launching every layer, the head, the host's books); a
           measured step is one, a prompt's prefill priced ahead is as many as the step budget cuts
           it into (a repair's second pass cannot share a step with its first)
  linear   token-layers: every row through every layer it runs (projections, MLP, norms)
  attend   query-key pairs per layer: a row at position p attends to p + 1 keys
  moved    token-layers of KV copied in and re-rotated for content reuse
and costs w_step * steps + w_linear * linear + w_attend * attend + w_moved * moved seconds. (A few rows over a
long context are bound by reading the KV, not by arithmetic, so the attend term, fitted mostly on
prefill steps, underprices them: docs/blend.md, the decode slowdown limit.) The weights start
from the model's arithmetic (FLOPs per unit, attention at half the linear layers' rate) and are fitted
to the step times the engine measures (`observe`) by least squares with positive weights; a kind of
work the recorded steps never had (moving KV, before the first content match) keeps its prior.

Only ratios between two plans for one prompt decide anything (ContentMatcher.choose), so what the
fit must get right is the relative price of linear work, attention and moving.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

PRIOR_FLOPS_PER_S = 5e10  # the scale of the prior only; the fit replaces it
ATTENTION_SLOWDOWN = 2.0  # attention runs at about half the FLOP rate of the GEMMs (profile_step.py)
REFIT_EVERY = 16  # observations
HISTORY = 256  # observations kept for the fit


@dataclass
class Work:
    steps: float = 1.0
    linear: float = 0.0
    attend: float = 0.0
    moved: float = 0.0

    def add_rows(self, positions_sum: float, num_rows: int, num_layers: int) -> None:
        """Rows whose positions sum to `positions_sum`, each through `num_layers` layers."""
        self.linear += num_rows * num_layers
        self.attend += (positions_sum + num_rows) * num_layers

    def add_span(self, start: int, end: int, num_layers: int) -> None:
        """Rows at every position of [start, end)."""
        n = end - start
        self.add_rows((start + end - 1) * n / 2, n, num_layers)

    def features(self) -> list[float]:
        return [self.steps, self.linear, self.attend, self.moved]


class CostModel:
    def __init__(
        self, num_layers: int, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, inter: int
    ):
        self.num_layers = num_layers
        params = hidden * (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim * hidden
        params += 3 * hidden * inter
        per_linear = 2 * params / PRIOR_FLOPS_PER_S
        per_attend = ATTENTION_SLOWDOWN * 4 * num_heads * head_dim / PRIOR_FLOPS_PER_S
        per_moved = 8 * num_kv_heads * head_dim * 4 / 5e9  # K and V read, rotated, written (fp32 passes)
        self.prior = [1e-3, per_linear, per_attend, per_moved]  # seconds per step, per unit
        self.weights = list(self.prior)
        self._seen: deque[tuple[list[float], float]] = deque(maxlen=HISTORY)
        self._since_fit = 0
        self.num_observed = 0

    @classmethod
    def of(cls, model_config: object, num_layers: int) -> CostModel:
        c = model_config
        heads = c.num_attention_heads  # type: ignore[attr-defined]
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads  # type: ignore[attr-defined]
        return cls(
            num_layers,
            c.hidden_size,  # type: ignore[attr-defined]
            heads,
            getattr(c, "num_key_value_heads", None) or heads,
            head_dim,
            c.intermediate_size,  # type: ignore[attr-defined]
        )

    def seconds(self, work: Work) -> float:
        return sum(w * x for w, x in zip(self.weights, work.features(), strict=True))

    def row_seconds(self, position: int) -> float:
        """One more row at `position` through every layer (no per-step part)."""
        w = self.weights
        return self.num_layers * (w[1] + w[2] * (position + 1))

    def observe(self, work: Work, seconds: float) -> None:
        """A step that did `work` took `seconds`; refits every REFIT_EVERY observations."""
        self._seen.append((work.features(), seconds))
        self.num_observed += 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            self.fit()

    def fit(self) -> None:
        """Least squares of the measured times on the work, weights kept positive (a kind whose
        weight comes out <= 0 is set to a hundredth of its prior and the rest refitted); a kind the
        recorded steps never had (no KV moved yet) keeps its prior."""
        if not self._seen:
            return
        prior = torch.tensor(self.prior, dtype=torch.float64)
        x = torch.tensor([f for f, _ in self._seen], dtype=torch.float64) * prior  # [n, kinds] prior seconds
        y = torch.tensor([t for _, t in self._seen], dtype=torch.float64)
        kinds = len(self.prior)
        c = torch.ones(kinds, dtype=torch.float64)
        active = [j for j in range(kinds) if bool(x[:, j].any())]
        while active:
            fixed = [j for j in range(kinds) if j not in active]
            rest = y - x[:, fixed] @ c[fixed]
            sol = torch.linalg.lstsq(x[:, active], rest.unsqueeze(1)).solution.squeeze(1)
            bad = [j for j, v in zip(active, sol.tolist(), strict=True) if v <= 0]
            if not bad:
                c[active] = sol
                break
            for j in bad:
                active.remove(j)
                c[j] = 0.01
        self.weights = (prior * c).tolist()
