"""Golden vectors for minikv's scorers, computed by kvpress 0.5.5 itself.

A tiny Llama attention layer (random weights, seeded) is run on random hidden
states; each press's own `score` (or `compress`) gives the reference output.
The inputs the Rust tests need (post-RoPE keys and queries, values, W_o, the
RoPE frequencies) are written beside the outputs, so the tests replay them
without torch. Run by scripts/xcheck-kvpress.sh; writes
minikv-policies/tests/golden/kvpress.json.
"""

import json
import sys

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding, rotate_half

import kvpress
import kvpress as K
from kvpress import (
    CapPress,
    CompactorPress,
    CriticalAdaKVPress,
    CURPress,
    FinchPress,
    KnormPress,
    LeverageScorePress,
    NonCausalAttnPress,
    SimLayerKVPress,
    SnapKVPress,
)
from kvpress.presses.block_press import BlockPress
from kvpress.presses.entropy_gated_chunkkv_press import EntropyGatedChunkKVPress
from kvpress.presses.merging_press import MergingPress

assert kvpress.__version__ if hasattr(kvpress, "__version__") else True

T, HQ, HKV, D, HIDDEN = 40, 4, 2, 8, 32
torch.manual_seed(1234)
cfg = LlamaConfig(
    hidden_size=HIDDEN,
    num_attention_heads=HQ,
    num_key_value_heads=HKV,
    head_dim=D,
    intermediate_size=64,
    num_hidden_layers=1,
    rope_theta=10000.0,
    max_position_embeddings=256,
)
cfg._attn_implementation = "sdpa"
attn = LlamaAttention(cfg, layer_idx=0).float()
with torch.no_grad():
    for p in attn.parameters():
        p.copy_(torch.randn_like(p) * 0.6)
rot = LlamaRotaryEmbedding(cfg)
hs = torch.randn(1, T, HIDDEN)
pos = torch.arange(T)[None]
cos, sin = rot(hs, pos)
kwargs = {"position_embeddings": (cos, sin), "cache_position": torch.arange(T)}


def heads(x, n):
    return x.view(1, T, n, D).transpose(1, 2)


def rope(x):
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


with torch.no_grad():
    keys = rope(heads(attn.k_proj(hs), HKV))
    values = heads(attn.v_proj(hs), HKV)
    pre_queries = heads(attn.q_proj(hs), HQ)
    queries = rope(pre_queries)
attn.rotary_emb = rot  # CapPress reads the module's rotary embedding

out = {
    "source": "kvpress 0.5.5 presses on a seeded tiny Llama attention layer (scripts/xcheck/kvpress_golden.py)",
    "t": T,
    "n_q_heads": HQ,
    "n_kv_heads": HKV,
    "head_dim": D,
    "inv_freq": rot.inv_freq.tolist(),
    "keys": keys[0].flatten().tolist(),
    "values": values[0].flatten().tolist(),
    "queries": queries[0].flatten().tolist(),
    "pre_rope_queries": pre_queries[0].flatten().tolist(),
    "w_o": attn.o_proj.weight.detach().flatten().tolist(),
    "cases": {},
}


def score(press):
    with torch.no_grad():
        return press.score(attn, hs, keys, values, None, kwargs)[0]


def kept(press):
    """Kept positions per KV head after a press's compress()."""
    attn.masked_key_indices = None
    with torch.no_grad():
        k2, _ = press.compress(attn, hs, keys.clone(), values.clone(), None, kwargs)
    m = getattr(attn, "masked_key_indices", None)
    if m is not None:
        res = []
        for h in range(HKV):
            gone = set(m[2][m[1] == h].tolist())
            res.append([j for j in range(T) if j not in gone])
        return res
    res = []
    for h in range(HKV):
        rows = k2[0, h]
        res.append(sorted(int((keys[0, h] - r).abs().sum(-1).argmin()) for r in rows))
    return res


cases = out["cases"]
cases["cur"] = {"scores": score(CURPress()).flatten().tolist()}
cases["cur_key_global"] = {
    "scores": score(CURPress(leverage_type="key", use_local_approximation=False, num_sinks=2)).flatten().tolist()
}

# kvpress draws the sketch with torch.randn and scales it by 1/sqrt(k); the
# draw is replaced by this one, and the scaled sketch is what the tests get.
raw = torch.randn(1, HKV, D, 6)
phi = raw / 6**0.5
real_randn = torch.randn
torch.randn = lambda *a, **k: raw.clone()
try:
    lev = score(LeverageScorePress(sketch_dimension=6))
    comp = score(CompactorPress(compression_ratio=0.5, chunk_size=7, sketch_dimension=6, blending=0.7))
finally:
    torch.randn = real_randn
cases["leverage"] = {"phi": phi[0].flatten().tolist(), "sketch": 6, "scores": lev.flatten().tolist()}
cases["compactor"] = {
    "phi": phi[0].flatten().tolist(),
    "sketch": 6,
    "chunk": 7,
    "blending": 0.7,
    "scores": comp.flatten().tolist(),
}
cases["non_causal_attention"] = {"chunk": 8, "scores": score(NonCausalAttnPress(chunk_size=8)).flatten().tolist()}

cases["cap"] = {
    "n_sink": 4,
    "n_future_positions": 16,
    "tau": 5.0,
    "scores": score(CapPress(n_sink=4, n_future_positions=16)).flatten().tolist(),
}

finch = FinchPress(compression_ratio=0.5)
finch.window_size = 8
cases["finch"] = {"window": 8, "scores": score(finch).flatten().tolist()}

cases["critical_ada_kv"] = {
    "budget": 20,
    "kept": kept(CriticalAdaKVPress(press=KnormPress(compression_ratio=0.5), alpha_safeguard=0.2)),
}
cases["critical_ada_kv_snapkv"] = {
    "budget": 20,
    "window": 8,
    "kernel": 5,
    "kept": kept(CriticalAdaKVPress(press=SnapKVPress(compression_ratio=0.5, window_size=8, kernel_size=5))),
}
for chunk, low in [(10, 4), (6, 2)]:
    cases[f"entropy_gated_chunk_kv_{chunk}"] = {
        "chunk": chunk,
        "spiky_keep": low,
        "budget": 16,
        "kept": kept(
            EntropyGatedChunkKVPress(
                press=KnormPress(compression_ratio=0.6), chunk_length=chunk, low_entropy_chunk_length=low
            )
        ),
    }

chunk = kept(K.ChunkKVPress(press=KnormPress(compression_ratio=0.5), chunk_length=6))
cases["chunk_kv_shared_mean"] = {"chunk": 6, "kept": chunk}

cases["block"] = {"block": 8, "budget": 20, "kept": kept(BlockPress(press=KnormPress(compression_ratio=0.5), block_size=8))}

for frac in [1.0, 0.5]:
    knorm = KnormPress(compression_ratio=0.5)
    with torch.no_grad():
        top = knorm.score(attn, hs, keys, values, None, kwargs).topk(20, dim=-1).indices[0]
        merge = MergingPress(press=KnormPress(compression_ratio=0.5), merge_fraction=frac)
        _, mv = merge.compress(attn, hs, keys.clone(), values.clone(), None, kwargs)
    kept_sets = [sorted(top[h].tolist()) for h in range(HKV)]
    # compress() returns the kept rows in top-k order
    order = [top[h].tolist() for h in range(HKV)]
    merged = [[mv[0, h, order[h].index(j)].tolist() for j in kept_sets[h]] for h in range(HKV)]
    cases[f"merge_similar_{frac}"] = {"merge_fraction": frac, "kept": kept_sets, "values": merged}

with torch.no_grad():
    w = SnapKVPress.compute_window_attention(attn, hs, keys, 2, (cos, sin)).mean((0, 1, 2))
share = float(w[:3].sum() + w[-12:].sum())
press = SimLayerKVPress(lazy_threshold=share - 1e-4, n_last=2, n_recent=12, n_initial=3)
with torch.no_grad():
    k_lazy, _ = press.compress(attn, hs, keys, values, None, kwargs)
cases["simlayerkv"] = {"n_last": 2, "n_recent": 12, "sinks": 3, "share": share, "lazy_len": k_lazy.shape[2]}

# Q-Filters: kvpress scores -(f . k) with per-model filters it downloads; a
# seeded unit filter per KV head stands in (minikv's file holds u = -f).
qf = torch.nn.functional.normalize(torch.randn(1, HKV, D), dim=-1)
qpress = K.QFilterPress(compression_ratio=0.5)
qpress.q_filters = qf
cases["qfilter"] = {"filters": qf[0].tolist(), "scores": score(qpress).flatten().tolist()}

json.dump(out, open(sys.argv[1], "w"), indent=0)
print("wrote", sys.argv[1], "cases:", ", ".join(cases))
