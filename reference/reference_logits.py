#!/usr/bin/env python3
"""Independent reference for minikv-models: SmolLM2 forward in numpy (float64),
weights dequantized by gguf-py (llama.cpp's Python package), tokenizer built
from the GGUF vocabulary with the Python `tokenizers` package.

Writes reference/smollm2_reference.json, which the Rust tests compare against.
Needs: pip install gguf numpy tokenizers  (CI does not run this script).

    python3 reference/reference_logits.py assets/SmolLM2-135M-Instruct.Q4_1.gguf assets/paul_graham
"""
import hashlib, json, os, sys
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, 3 astronauts flew 384400 km to the Moon.",
]
STRIDE = 97  # every 97th vocabulary id is stored besides the top 64

def field(r, k):
    return r.fields[k].contents()

def load(path):
    r = GGUFReader(path)
    W = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        W[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim > 1 else a.reshape(-1)
    cfg = dict(
        L=field(r, "llama.block_count"), H=field(r, "llama.embedding_length"),
        nh=field(r, "llama.attention.head_count"), nkv=field(r, "llama.attention.head_count_kv"),
        base=field(r, "llama.rope.freq_base"), eps=field(r, "llama.attention.layer_norm_rms_epsilon"),
    )
    return r, W, cfg

def tokenizer(r):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, AddedToken
    toks = field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    types = field(r, "tokenizer.ggml.token_type")
    tk = Tokenizer(models.BPE({t: i for i, t in enumerate(toks)}, merges))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(toks, types) if ty in (3, 4)])
    return tk

def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

def rope(x, base):  # x: [T, heads, d], adjacent pairs (GGUF layout)
    T, _, d = x.shape
    inv = base ** (-np.arange(0, d, 2) / d)
    ang = np.arange(T)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out

def forward(W, c, ids):
    T, H, nh, nkv = len(ids), c["H"], c["nh"], c["nkv"]
    d = H // nh
    x = W["token_embd.weight"][ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(c["L"]):
        p = f"blk.{l}."
        h = rms(x, W[p + "attn_norm.weight"], c["eps"])
        q = rope((h @ W[p + "attn_q.weight"].T).reshape(T, nh, d), c["base"])
        k = rope((h @ W[p + "attn_k.weight"].T).reshape(T, nkv, d), c["base"])
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, nkv, d)
        g = nh // nkv
        o = np.empty((T, nh, d))
        for hh in range(nh):
            s = q[:, hh] @ k[:, hh // g].T / np.sqrt(d) + mask
            s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True)
            o[:, hh] = s @ v[:, hh // g]
        x = x + o.reshape(T, H) @ W[p + "attn_output.weight"].T
        h = rms(x, W[p + "ffn_norm.weight"], c["eps"])
        gg = h @ W[p + "ffn_gate.weight"].T
        x = x + ((gg / (1 + np.exp(-gg))) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    x = rms(x, W["output_norm.weight"], c["eps"])
    head = W.get("output.weight", W["token_embd.weight"])
    return x @ head.T

def main():
    model, texts = sys.argv[1], sys.argv[2]
    r, W, c = load(model)
    tk = tokenizer(r)
    out = {"model_sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(), "stride": STRIDE, "prompts": []}
    for pr in PROMPTS:
        ids = tk.encode(pr).ids
        lg = forward(W, c, ids)[-1]
        top = np.argsort(-lg, kind="stable")[:64]
        out["prompts"].append({"prompt": pr, "ids": ids,
                               "top": [[int(i), float(lg[i])] for i in top],
                               "strided": [float(v) for v in lg[::STRIDE]]})
        print(pr[:40], ids[:8], [tk.decode([int(i)]) for i in top[:3]], file=sys.stderr)
    files = sorted(f for f in os.listdir(texts) if f.endswith(".txt"))
    text = open(os.path.join(texts, files[0]), encoding="utf-8").read()
    ids = tk.encode(text).ids[:512]
    lg = forward(W, c, ids)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    nll = float(np.mean(lse[:-1] - lg[np.arange(511), ids[1:]]))
    out["perplexity"] = {"file": files[0], "tokens": 512, "first_ids": ids[:16], "nll": nll, "ppl": float(np.exp(nll))}
    print("ppl", out["perplexity"], file=sys.stderr)
    json.dump(out, open(os.path.join(os.path.dirname(__file__), "smollm2_reference.json"), "w"), indent=1)

if __name__ == "__main__":
    main()
