"""Issue 38 experiment: K error and attention error of turbo K with and without per-block centring
(the block's per-channel K mean, fp16, subtracted before the rotation and added back), against KIVI
K, and of each V codec. SmolLM2 on bench_kv_quality's captured text (harness/kv_quality.py); prints
one line per variant.

    .venv/bin/python scripts/kv_center_experiment.py
"""

from harness import kv_quality as b

from kvserve.quant.registry import make_codec

model, tok = b.load_model("/tmp/kvserve_smollm2_hf")
ids = b.token_batch(tok, b.CAPTURE_TOPICS, 512)
cap = b.capture(model, ids)
H, D = cap[0][1].shape[1], cap[0][1].shape[3]


def rt_turbo(name, x, center):  # x [B,H,T,D]
    c = make_codec(name, H, D, 0).k
    t = x.permute(0, 2, 1, 3)  # B,T,H,D
    Bn, T = t.shape[:2]
    blocks = t.reshape(Bn, T // 16, 16, H, D)
    mu = blocks.mean(2, keepdim=True).half().float() if center else 0
    y = c.roundtrip(blocks - mu) + mu
    return y.reshape(Bn, T, H, D).permute(0, 2, 1, 3)


def rt(name, which, x):
    return b.roundtrip_tokens(make_codec(name, H, D, 0), which, x)


rows = {}
for label, fk, fv in [
    ("K turbo3", lambda k: rt_turbo("turbo3", k, False), None),
    ("K turbo3 centered", lambda k: rt_turbo("turbo3", k, True), None),
    ("K turbo2 centered", lambda k: rt_turbo("turbo2", k, True), None),
    ("K turbo2", lambda k: rt_turbo("turbo2", k, False), None),
    ("K turbo4", lambda k: rt_turbo("turbo4", k, False), None),
    ("K int3", lambda k: rt("int3", "k", k), None),
    ("K int2", lambda k: rt("int2", "k", k), None),
    ("K int4", lambda k: rt("int4", "k", k), None),
    ("V turbo2", None, lambda v: rt("turbo2", "v", v)),
    ("V turbo3", None, lambda v: rt("turbo3", "v", v)),
    ("V turbo4", None, lambda v: rt("turbo4", "v", v)),
    ("V int2", None, lambda v: rt("int2", "v", v)),
    ("V int3", None, lambda v: rt("int3", "v", v)),
    ("V int4", None, lambda v: rt("int4", "v", v)),
]:
    err = kerr = 0.0
    for q, k, v in cap:
        kh = fk(k) if fk else k
        vh = fv(v) if fv else v
        ref = b.attention(q, k, v, 256)
        err += float((b.attention(q, kh, vh, 256) - ref).norm() / ref.norm())
        kerr += (
            float((kh - k).pow(2).sum() / k.pow(2).sum())
            if fk
            else float((vh - v).pow(2).sum() / v.pow(2).sum())
        )
    print(f"{label:22s} attn_err {err / len(cap):.4f}  rel_mse {kerr / len(cap):.4f}", flush=True)
