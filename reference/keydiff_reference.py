"""Independent mirror of KeyDiff scoring (docs/algorithms.md, KeyDiff) in plain
Python, for the worked example of minikv-policies/tests/policies.rs.

Keys of the §4 worked example: k[j][c] = 2 cos(0.3 + 1.1 j + 0.9 c), T = 12,
d = 4, one head. The anchor is the mean of the L2-normalized keys; a token's
score is -cos(k_j, anchor). Run: python3 reference/keydiff_reference.py
"""
import math

T, D = 12, 4
keys = [[2 * math.cos(0.3 + 1.1 * j + 0.9 * c) for c in range(D)] for j in range(T)]


def norm(v):
    return math.sqrt(sum(x * x for x in v))


unit = [[x / norm(k) for x in k] for k in keys]
anchor = [sum(u[c] for u in unit) / T for c in range(D)]
scores = [-sum(a * b for a, b in zip(k, anchor)) / (norm(k) * norm(anchor)) for k in keys]
print(" ".join(f"{s:.6f}" for s in scores))
