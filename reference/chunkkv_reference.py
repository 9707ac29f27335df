"""Independent mirror of ChunkKV over key-norm scores, for the worked example
of minikv-policies/tests/policies.rs: keys of the §4 example
(k[j][c] = 2 cos(0.3 + 1.1 j + 0.9 c), T = 12, d = 4), scores -||k_j||, summed
over chunks of 4; the kept set for a budget of 4 tokens is the best chunk.
Run: python3 reference/chunkkv_reference.py
"""
import math

T, D, C = 12, 4, 4
keys = [[2 * math.cos(0.3 + 1.1 * j + 0.9 * c) for c in range(D)] for j in range(T)]
score = [-math.sqrt(sum(x * x for x in k)) for k in keys]
chunks = [sum(score[i:i + C]) for i in range(0, T, C)]
best = max(range(len(chunks)), key=lambda i: (chunks[i], -i))
print(" ".join(f"{s:.6f}" for s in chunks))
print("kept", list(range(best * C, best * C + C)))
