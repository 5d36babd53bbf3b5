"""The fused forward's last layer computes, past its KV write, only the rows whose hidden state leaves
the model (ModelRunner._takes_tail, models/fused_llama.py LayerTail): the sampled rows. Every logit
must be bitwise what the full last layer gives, in prefill slices (a slice before a prompt's last
samples nothing), next to decode rows, cold and warm."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.model_runner import ModelRunner
from kvserve.kernels import cpu_ext
from tests.integration.helpers import corpus_token_ids, generate_with_logits

pytestmark = pytest.mark.skipif(
    bool(cpu_ext.unavailable_reason()), reason="the fused forward needs the CPU extension (a C++ compiler)"
)

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model", ["tiny-random-llama", "tiny-random-qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_last_layer_of_the_sampled_rows_only_changes_no_logit(model, dtype, monkeypatch):
    common = dict(model=model, dtype=dtype, chunk_size=32, block_size=16, max_num_batched_tokens=80)
    tail, full = LLM(**common), LLM(enable_prefix_caching=False, **common)
    assert tail.engine.runner.fused is not None
    prompts = [corpus_token_ids(tail, n, seed=n) for n in (7, 50, 130, 200)]
    taken = []  # per step: whether its inputs have a tail
    prepare = ModelRunner.prepare_inputs

    def counted(self, batch):
        inputs = prepare(self, batch)
        taken.append(inputs.tail is not None)
        return inputs

    monkeypatch.setattr(ModelRunner, "prepare_inputs", counted)
    cold, cold_logits = generate_with_logits(tail, prompts, GREEDY)
    warm, warm_logits = generate_with_logits(tail, prompts[2:], GREEDY)  # prefix hits, short suffixes
    assert any(taken) and not all(taken)  # prefill steps take it; decode steps (every row sampled) do not
    assert all(o.num_cached_tokens > 0 for o in warm)
    monkeypatch.setattr(ModelRunner, "_takes_tail", lambda self, *args: False)
    want, want_logits = generate_with_logits(full, prompts, GREEDY)
    for got, ref in zip(cold_logits + warm_logits, want_logits + want_logits[2:], strict=True):
        assert got.shape == ref.shape and got.equal(ref)
    assert [o.token_ids for o in cold + warm] == [o.token_ids for o in want + want[2:]]
