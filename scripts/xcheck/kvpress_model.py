"""Model-level cross-check of minikv against kvpress 0.5.5 on identical tokens.

For each context (a file of token ids written by `minikv tokenize`), each
method present in both and each compression ratio, both sides prefill the
same `context` ids with the method, then are teacher-forced through the next
`tokens` ids; each side's per-step KL(full || compressed) is taken against its
own full cache (kvpress: transformers with the GGUF dequantized to f32; minikv:
`minikv eval --task fidelity --ids`). Writes one JSON line per
(context, method, ratio) to the output file (appending; a row already there is
skipped, so a killed run resumes).

Usage: kvpress_model.py OUT.jsonl IDS.json [IDS.json ...]
Env: XCHECK_RATIOS (0.5), XCHECK_CONTEXT (2048), XCHECK_TOKENS (64),
XCHECK_METHODS (comma-separated names; default all), MINIKV (binary).
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import kvpress as K
from kvpress.presses.block_press import BlockPress
from kvpress.presses.entropy_gated_chunkkv_press import EntropyGatedChunkKVPress
from kvpress.presses.merging_press import MergingPress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MINIKV = os.environ.get("MINIKV", os.path.join(ROOT, "target/release/minikv"))
CONTEXT = int(os.environ.get("XCHECK_CONTEXT", "2048"))
TOKENS = int(os.environ.get("XCHECK_TOKENS", "64"))
RATIOS = [float(r) for r in os.environ.get("XCHECK_RATIOS", "0.5").split(",")]


def snap():
    return K.SnapKVPress(window_size=64, kernel_size=5)


def finch(r):
    p = K.FinchPress(compression_ratio=r, rerotate_keys=False)
    p.window_size = 64
    p.delimiter_token_id = -1  # no delimiter in the ids: the window stays 64
    return p


QFILTERS = os.path.join(ROOT, "configs/patterns/smollm2-135m-instruct-q4_1.qfilters.json")


def qfilter(r):
    # kvpress has no Q-Filters for SmolLM2 (its loader downloads per-model
    # filters): it gets minikv's calibrated directions, negated (kvpress
    # scores -(f . k), minikv <k, u>), so both sides score the same keys.
    # minikv's channels are the GGUF file's (RoPE on adjacent pairs: 2i,
    # 2i+1); transformers un-permutes them to its half-split layout (i,
    # i + d/2): the filters are reordered the same way.
    u = torch.tensor(json.load(open(QFILTERS))["filters"], dtype=torch.float32)
    f = -torch.cat([u[..., 0::2], u[..., 1::2]], dim=-1)

    class Press(K.QFilterPress):
        def post_init_from_model(self, model):
            self.q_filters = f

    return Press(compression_ratio=r)


LUKV = os.path.join(ROOT, "configs/patterns/smollm2-135m-instruct-q4_1.lukv.json")


def lukv(r):
    # kvpress ships one budget curve (an 8B model, fetched at run time):
    # it gets minikv's SmolLM2 curve (`minikv calibrate lukv`), the same
    # [99][layer][KV head] pruned shares, so both sides split the same way.
    import numpy as np

    p = K.LUKVPress(press=K.ExpectedAttentionPress(epsilon=2e-2), compression_ratio=r, sink=4, window=1)
    p._budget_curves = np.array(json.load(open(LUKV))["prune"], dtype=np.float32)
    return p


DUO = os.path.join(ROOT, "configs/patterns/smollm2-135m-instruct-q4_1.duo.json")


def duo(r):
    # kvpress downloads DuoAttention patterns for six 7-8B models: it gets
    # minikv's SmolLM2 pattern (per layer and KV head, higher = retrieval)
    # with the sinks and window it was calibrated for; the lowest-scored
    # half of the heads stream (kvpress's own rule).
    import numpy as np

    pat = json.load(open(DUO))

    class Press(K.DuoAttentionPress):
        def post_init_from_model(self, model):
            self.sink_size, self.recent_size = pat["calibration"]["sinks"], pat["calibration"]["recent"]
            scores = np.array(pat["scores"], dtype=float)
            n_pruned = round(scores.size * self.head_compression_ratio)
            self.streaming_mask = torch.zeros(scores.shape, dtype=bool)
            idx = np.argsort(scores, axis=None, kind="stable")[:n_pruned]
            self.streaming_mask[np.unravel_index(idx, scores.shape)] = True

    return Press(head_compression_ratio=0.5)


def kvzip(r, layerwise=False):
    # KVzipPress reads the tokenizer from the model's name and wraps the
    # reconstruction instructions in its chat template when it has one;
    # minikv repeats the context with no template (suffix "\n", as kvpress
    # does for a model without one). kvpress gets the GGUF's tokenizer with
    # its template removed, so both sides feed the same pass tokens.
    import kvpress.presses.kvzip_press as kz
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.chat_template = None
    kz.AutoTokenizer.from_pretrained = lambda *a, **k: tok
    return K.KVzipPress(compression_ratio=r, layerwise=layerwise)


# name -> (minikv preset under configs/kvpress, kvpress press for ratio r, note
#          [, text edits of the preset for this row])
METHODS = {
    "snapkv": ("snapkv", lambda r: K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5), ""),
    "knorm": ("knorm", lambda r: K.KnormPress(compression_ratio=r), ""),
    "keydiff": ("keydiff", lambda r: K.KeyDiffPress(compression_ratio=r), ""),
    "streamingllm": ("streamingllm", lambda r: K.StreamingLLMPress(compression_ratio=r, n_sink=4), ""),
    "expected-attention": ("expected-attention", lambda r: K.ExpectedAttentionPress(compression_ratio=r), ""),
    "adakv-expected-attention": (
        "adakv-expected-attention",
        lambda r: K.AdaKVPress(K.ExpectedAttentionPress(compression_ratio=r)),
        "",
    ),
    "criticalkv": (
        "criticalkv",
        lambda r: K.CriticalKVPress(K.ExpectedAttentionPress(compression_ratio=r, use_vnorm=False)),
        "",
    ),
    "criticalkv-snapkv": (
        "criticalkv-snapkv",
        lambda r: K.CriticalKVPress(K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)),
        "",
    ),
    "criticalkv-snapkv-summed": (
        "criticalkv-snapkv",
        lambda r: K.CriticalKVPress(K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)),
        "minikv's SnapKV summing its window rows (SnapKV's scale): epsilon weighs 64x less",
        [("average = true", "average = false")],
    ),
    "think": (
        "think",
        lambda r: K.ComposedPress(
            [K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5), K.ThinKPress(key_channel_compression_ratio=0.5, window_size=32)]
        ),
        "",
    ),
    "think-prune-appended": (
        "think",
        lambda r: K.ComposedPress(
            [K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5), K.ThinKPress(key_channel_compression_ratio=0.5, window_size=32)]
        ),
        "minikv option `prune_appended = true`: decoded keys pruned too; kvpress keeps them whole",
        [("window = 32", "window = 32\nprune_appended = true")],
    ),
    "key-rerotation": (
        "key-rerotation",
        lambda r: K.KeyRerotationPress(K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)),
        "",
    ),
    "lagkv": ("lagkv", lambda r: K.LagKVPress(compression_ratio=r), ""),
    "chunkkv": ("chunkkv", lambda r: K.ChunkKVPress(K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5), chunk_length=20), ""),
    "pyramidkv": ("pyramidkv", lambda r: K.PyramidKVPress(compression_ratio=r, window_size=64, kernel_size=5), ""),
    "random": ("random", lambda r: K.RandomPress(compression_ratio=r, seed=0), "different random draws"),
    "cur": ("cur", lambda r: K.CURPress(compression_ratio=r), ""),
    "leverage": ("leverage", lambda r: K.LeverageScorePress(compression_ratio=r), "different sketch draws"),
    "non-causal-attention": ("non-causal-attention", lambda r: K.NonCausalAttnPress(compression_ratio=r), ""),
    "compactor": ("compactor", lambda r: K.CompactorPress(compression_ratio=r), "different sketch draws"),
    "finch": ("finch", finch, "fixed 64-token window, no key re-rotation on either side"),
    "cap": ("cap", lambda r: K.CapPress(compression_ratio=r), ""),
    "entropy-gated-chunkkv": (
        "entropy-gated-chunkkv",
        lambda r: EntropyGatedChunkKVPress(press=K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)),
        "",
    ),
    "critical-adakv": ("critical-adakv", lambda r: K.CriticalAdaKVPress(press=K.SnapKVPress(compression_ratio=r, window_size=64, kernel_size=5)), ""),
    "block": ("block", lambda r: BlockPress(press=K.KeyDiffPress(compression_ratio=r), block_size=128), ""),
    "merge-similar": ("merge-similar", lambda r: MergingPress(press=K.KnormPress(compression_ratio=r)), ""),
    "qfilter": ("qfilter", qfilter, "the same filters on both sides (minikv's calibration)"),
    "lukv": ("lukv", lukv, "the same budget curve on both sides (minikv's calibration)"),
    "kvcompose": ("kvcompose", lambda r: K.KVComposePress(compression_ratio=r), ""),
    "kvzip": ("kvzip", kvzip, "no chat template on either side"),
    "kvzip-layerwise": (
        "kvzip",
        lambda r: kvzip(r, layerwise=True),
        "kvpress's layerwise = True: every layer keeps 1 - ratio",
        [('policy = { type = "kvzip" }\n', "")],
    ),
}
# Methods whose budget is not a ratio of the prompt (run once).
FIXED = {
    "simlayerkv": ("simlayerkv", lambda r: K.SimLayerKVPress(lazy_threshold=0.9, n_last=1, n_recent=1024, n_initial=4), ""),
    # kvpress's decoding presses, compressing every 16 of the 64 decode steps
    # (their default 512 would never fire here).
    "decoding": (
        "decoding",
        lambda r: K.DecodingPress(base_press=K.KnormPress(), compression_interval=16, target_size=1024),
        "every 16 steps to 1024 rows",
        [("every = 512, target_tokens = 2048", "every = 16, target_tokens = 1024")],
    ),
    "compression-ratio-decoding": (
        "compression-ratio-decoding",
        lambda r: K.CompressionRatioDecodingPress(
            base_press=K.KnormPress(), target_compression_ratio=0.5, compression_interval=16
        ),
        "every 16 steps to half the rows seen",
        [("every = 512", "every = 16")],
    ),
    "duo-attention": ("duo-attention", duo, "half the heads stream (4 sinks + 128); the same pattern on both sides (minikv's calibration)"),
    # SnapKV on the prompt (half removed), key norm while decoding: every 16
    # steps each head back to 768 rows (the prompt keeps 1024).
    "prefill-decoding": (
        "prefill-decoding",
        lambda r: K.PrefillDecodingPress(
            prefilling_press=K.SnapKVPress(compression_ratio=0.5, window_size=64, kernel_size=5),
            decoding_press=K.DecodingPress(base_press=K.KnormPress(), compression_interval=16, target_size=768),
        ),
        "SnapKV 0.5 on the prompt, every 16 steps to 768 rows by key norm",
        [("every = 512, target_tokens = 2048", "every = 16, target_tokens = 768")],
    ),
}
DECODING = {"decoding", "compression-ratio-decoding", "prefill-decoding"}


def quanto(nbits):
    # transformers' QuantizedCache (the quantized-cache path kvpress runs on):
    # optimum-quanto, its default axes (0: groups of q_group_size consecutive
    # channels of one token, here the whole 64-channel head vector), residual
    # 128 (the prompt is quantized whole at prefill; decoded tokens stay
    # full precision until 128 gather, then everything is re-quantized).
    from transformers import QuantizedCache

    return lambda config: QuantizedCache(
        backend="quanto", config=config, nbits=nbits, q_group_size=64, residual_length=128
    )


# Quantized caches: name -> (minikv preset under configs/, transformers'
# quantized cache for the model's config, note[, text edits]). No press.
QUANTIZED = {
    "kivi-2bit": ("../kivi-2bit", quanto(2), "different quantizers: see the text"),
    "kivi-4bit": ("../kivi-4bit", quanto(4), "different quantizers: see the text"),
    "kivi-2bit-as-quanto": (
        "../kivi-2bit",
        quanto(2),
        "minikv with quanto's grouping: keys and values per token, one group of 64 channels",
        [
            ('keys = { type = "minmax", bits = 2, group = 32, axis = "channel" }',
             'keys = { type = "minmax", bits = 2, group = 64, axis = "token" }'),
            ('values = { type = "minmax", bits = 2, group = 32, axis = "token" }',
             'values = { type = "minmax", bits = 2, group = 64, axis = "token" }'),
        ],
    ),
}


def kl_steps(full, comp):
    lf = torch.log_softmax(full.double(), -1)
    lc = torch.log_softmax(comp.double(), -1)
    return (lf.exp() * (lf - lc)).sum(-1).tolist()


def teacher_forced(model, ids, press, decoding=False, cache=None):
    """Logits predicting ids[CONTEXT + j] for j < TOKENS, the prompt compressed by
    `press` (with `decoding`, the press stays active through the decode steps:
    kvpress's decoding presses compress there), in `cache` (default: a
    DynamicCache)."""
    ctx = torch.tensor([ids[:CONTEXT]])
    cache = DynamicCache() if cache is None else cache
    rows = []

    def decode():
        for j in range(1, TOKENS):
            pos = torch.tensor([[CONTEXT + j - 1]])
            out = model(input_ids=torch.tensor([[ids[CONTEXT + j - 1]]]), past_key_values=cache, position_ids=pos)
            rows.append(out.logits[0, -1])

    with torch.no_grad():
        with press(model) if press is not None else torch.no_grad():
            out = model(input_ids=ctx, past_key_values=cache, logits_to_keep=1)
            rows.append(out.logits[0, -1])
            if decoding:
                decode()
        if not decoding:
            decode()
    return torch.stack(rows), cache.get_seq_length()


def minikv(preset, ratio, ids_file, edits=()):
    text = open(os.path.join(ROOT, "configs/kvpress", preset + ".toml")).read()
    for old, new in edits:
        assert old in text, f"{preset}: no `{old}` to edit"
        text = text.replace(old, new)
    if ratio is not None:
        text = re.sub(r"(?m)^heavy = 0\.5$", f"heavy = {1 - ratio}", text)
    # (a preset's files are named relative to configs/kvpress: made absolute,
    # so the copy may live anywhere)
    text = text.replace('"../patterns/', '"' + os.path.join(ROOT, "configs/patterns") + "/")
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        out = subprocess.run(
            [MINIKV, "eval", "--config", f.name, "--task", "fidelity", "--ids", ids_file,
             "--context", str(CONTEXT), "--tokens", str(TOKENS), "--json"],
            check=True, capture_output=True, text=True,
        ).stdout
    finally:
        os.unlink(f.name)
    r = json.loads(out)
    return r["metrics"]["kl_per_step"], r["memory"]["kv_bytes"] if "memory" in r else None


def main():
    out_path, id_files = sys.argv[1], sys.argv[2:]
    done = set()
    if os.path.exists(out_path):
        for line in open(out_path):
            try:
                r = json.loads(line)
                done.add((r["context_file"], r["method"], r["ratio"]))
            except (ValueError, KeyError):
                pass
    want = os.environ.get("XCHECK_METHODS")
    want = set(want.split(",")) if want else None
    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(ROOT, "assets"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    )
    model.eval()
    for idf in id_files:
        ids = json.load(open(idf))[: CONTEXT + TOKENS]
        assert len(ids) == CONTEXT + TOKENS, f"{idf}: {len(ids)} ids, need {CONTEXT + TOKENS}"
        ids_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False).name
        json.dump(ids, open(ids_file, "w"))
        full, _ = teacher_forced(model, ids, None)
        jobs = (
            [(n, m, r) for n, m in METHODS.items() for r in RATIOS]
            + [(n, m, None) for n, m in FIXED.items()]
            + [(n, m, None) for n, m in QUANTIZED.items()]
        )
        for name, (preset, make, note, *edits), ratio in jobs:
            key = (os.path.basename(idf), name, ratio)
            if (want and name not in want) or key in done:
                continue
            t0 = time.time()
            if name in QUANTIZED:
                comp, kept = teacher_forced(model, ids, None, cache=make(model.config))
            else:
                comp, kept = teacher_forced(model, ids, make(ratio if ratio is not None else 0.0), name in DECODING)
            kv = kl_steps(full, comp)
            mk, _ = minikv(preset, ratio, ids_file, edits[0] if edits else ())
            row = {
                "context_file": key[0], "method": name, "ratio": ratio, "preset": os.path.normpath(f"configs/kvpress/{preset}.toml"),
                "context": CONTEXT, "tokens": TOKENS, "kvpress_kept_tokens": kept,
                "kvpress_kl": sum(kv) / len(kv), "minikv_kl": sum(mk) / len(mk),
                "kvpress_kl_steps": kv, "minikv_kl_steps": mk, "note": note,
                "kvpress": "0.5.5", "torch": torch.__version__, "seconds": round(time.time() - t0, 1),
            }
            with open(out_path, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{key[0]} {name} r={ratio}: kvpress {row['kvpress_kl']:.4f} minikv {row['minikv_kl']:.4f}", flush=True)
        os.unlink(ids_file)


if __name__ == "__main__":
    main()
