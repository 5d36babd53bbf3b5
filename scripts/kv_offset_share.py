"""Issue 38 experiment: the share of K's energy that is its per-channel mean over 512 tokens of text,
per layer (mean and worst layer). A large share is an offset that rotation codecs (turbo*) quantize
along with the signal; KIVI's per-channel zero point removes it.

    .venv/bin/python scripts/kv_offset_share.py MODEL_DIR   # an HF model directory
"""

import sys
from pydoc_data.topics import topics

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

path = sys.argv[1]
m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(path)
ids = tok(topics["assignment"], return_tensors="pt").input_ids[:, :512]
c = DynamicCache(config=m.config)
with torch.no_grad():
    m(ids, past_key_values=c, use_cache=True)
r = []
for layer in c.layers:
    k = layer.keys[0].float()  # H,T,D
    mu = k.mean(1, keepdim=True)
    r.append(float((mu.pow(2).sum(-1).mean()) / k.pow(2).sum(-1).mean()))
print(
    f"share of K energy in its per-channel mean over tokens: mean {sum(r) / len(r):.3f}, "
    f"max {max(r):.3f} over layers"
)
