"""Independent plain-Python mirrors of Expected Attention, CriticalKV, LagKV,
CaM merge and kvpress's PyramidKV schedule (docs/algorithms.md), written from
the formulas, for the worked examples of minikv-policies/tests/methods.rs.

Shared tensors: T = 12 prompt tokens, d = 4, one KV head read by two query
heads.
  keys (post-RoPE)    k[j][c] = 2 cos(0.3 + 1.1 j + 0.9 c)
  values              v[j][c] = cos(0.2 + 0.7 j - 0.4 c)
  pre-RoPE queries    q[i][h][c] = 2 sin(1 + 0.7 i + 1.3 c + 0.5 h)
  RoPE                base 100, adjacent pairs (2i, 2i+1), inv_freq_i = 100^(-2i/d)
  output projection   W_o[r][h*d + c] = 0.5 cos(0.3 r + 0.7 (h*d + c)), 3 rows

Run: python3 reference/kvpress_methods_reference.py
"""
import math

T, D, HQ = 12, 4, 2
K = [[2 * math.cos(0.3 + 1.1 * j + 0.9 * c) for c in range(D)] for j in range(T)]
V = [[math.cos(0.2 + 0.7 * j - 0.4 * c) for c in range(D)] for j in range(T)]
Q = [[[2 * math.sin(1 + 0.7 * i + 1.3 * c + 0.5 * h) for c in range(D)] for h in range(HQ)] for i in range(T)]
INV = [100.0 ** (-2 * i / D) for i in range(D // 2)]
WO = [[0.5 * math.cos(0.3 * r + 0.7 * col) for col in range(HQ * D)] for r in range(3)]


def fmt(xs):
    return ", ".join(f"{x:.6f}" for x in xs)


def softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


# ---- Expected Attention: n_sink 2, 8 future positions --------------------
def expected_attention(n_sink=2, n_future=8):
    # averaged rotation matrix R = mean_p R(p), p in T .. T + n_future
    R = [[0.0] * D for _ in range(D)]
    for p in range(T, T + n_future):
        for i, f in enumerate(INV):
            a, b = 2 * i, 2 * i + 1
            co, si = math.cos(p * f), math.sin(p * f)
            R[a][a] += co / n_future
            R[a][b] += -si / n_future
            R[b][a] += si / n_future
            R[b][b] += co / n_future
    out = []
    for h in range(HQ):
        qs = [Q[i][h] for i in range(n_sink, T)]
        n = len(qs)
        mu = [sum(q[c] for q in qs) / n for c in range(D)]
        cov = [[sum((q[a] - mu[a]) * (q[b] - mu[b]) for q in qs) / n for b in range(D)] for a in range(D)]
        mu2 = [sum(R[a][c] * mu[c] for c in range(D)) for a in range(D)]
        rc = [[sum(R[a][x] * cov[x][b] for x in range(D)) for b in range(D)] for a in range(D)]
        cov2 = [[sum(rc[a][x] * R[b][x] for x in range(D)) for b in range(D)] for a in range(D)]
        logits = []
        for j in range(n_sink, T):
            k = K[j]
            s = sum(k[c] * mu2[c] for c in range(D)) / math.sqrt(D)
            s += sum(k[a] * cov2[a][b] * k[b] for a in range(D) for b in range(D)) / D / 2
            logits.append(s)
        p = softmax(logits)
        row = [0.0] * n_sink + [p[j - n_sink] * math.sqrt(sum(x * x for x in V[j])) for j in range(n_sink, T)]
        out.append(row)
    top = max(x for row in out for x in row[n_sink:])
    for row in out:
        for j in range(n_sink):
            row[j] = top + 1
    return out


ea = expected_attention()
print("expected_attention head 0:", fmt(ea[0]))
print("expected_attention head 1:", fmt(ea[1]))
kv = [(a + b) / 2 for a, b in zip(ea[0], ea[1])]
cand = sorted(range(T - 3), key=lambda j: (-kv[j], j))[:4]
print("expected_attention kept (4 heavy + 3 recent):", sorted(cand) + [9, 10, 11])


# ---- CriticalKV over key norm (-||k||), budget 4 heavy, first stage 0.5 ---
def criticalkv(budget=4, ratio=0.5, eps=1e-4):
    s = [-math.sqrt(sum(x * x for x in k)) for k in K]
    first = sorted(range(T), key=lambda j: (-s[j], j))[: int(budget * ratio)]
    norm = []
    for j in range(T):
        acc = 0.0
        for h in range(HQ):
            acc += sum(abs(sum(WO[r][h * D + c] * V[j][c] for c in range(D))) for r in range(3))
        norm.append(acc / HQ)
    s2 = [(a + eps) * n for a, n in zip(s, norm)]
    top = max(s2)
    for j in first:
        s2[j] = top + 1
    return s2


ck = criticalkv()
print("criticalkv:", fmt(ck))


# ---- LagKV: n_sink 2, lag 3 ----------------------------------------------
def lag_stat(x, ref):
    lo = [min(r[c] for r in ref) for c in range(D)]
    hi = [max(r[c] for r in ref) for c in range(D)]
    out = []
    for row in x:
        z = [(row[c] - lo[c]) / (hi[c] - lo[c]) if hi[c] > lo[c] else 0.0 for c in range(D)]
        m = sum(z) / D
        out.append(math.sqrt(sum((v - m) ** 2 for v in z) / (D - 1)))
    return softmax(out)


def lagkv(n_sink=2, lag=3, cross=False, t=T):
    # protected tokens: 1 (above every rank); 2 with cross scoring (above any
    # softmax value, which can round to 1)
    score = [2.0 if cross else 1.0] * t
    if t < n_sink + 2 * lag:
        for i in range(n_sink, t):
            score[i] = (i - n_sink) / (t - n_sink)
        return score
    end = n_sink + ((t - n_sink) // lag) * lag
    parts = (end - n_sink) // lag
    for p in range(parts - 1):
        a = n_sink + p * lag
        ks = lag_stat(K[a:a + lag], K[a + lag:a + 2 * lag])
        vs = lag_stat(V[a:a + lag], V[a + lag:a + 2 * lag])
        s = [(x + y) / 2 for x, y in zip(ks, vs)]
        if not cross:
            order = sorted(range(lag), key=lambda i: (s[i], i))
            r = [0.0] * lag
            for rank, i in enumerate(order):
                r[i] = rank / lag
            s = r
        score[a:a + lag] = s
    return score


print("lagkv ranks:", fmt(lagkv()))
print("lagkv cross:", fmt(lagkv(cross=True)))
print("lagkv short (T = 7):", fmt(lagkv(t=7)))


# ---- CaM merge: kept [0, 3, 4, 8, 10, 11], scores A_j = 1 + (j mod 5), m = 2 -
def cam(kept, scores, m=2, normalize=False):
    vals = {k: list(V[k]) for k in kept}
    weight = {k: 1.0 for k in kept}
    for i in range(T):
        if i in kept:
            continue
        win = [k for k in kept if k > i][:m]
        if not win:
            continue
        mean = sum(scores[k] for k in win) / len(win)
        p = min(max(scores[i] / mean, 0.0), 1.0) if mean > 0 else 0.0
        for k in win:
            weight[k] += p / len(win)
            vals[k] = [a + p / len(win) * b for a, b in zip(vals[k], V[i])]
    if normalize:
        for k in kept:
            vals[k] = [a / weight[k] for a in vals[k]]
    return [x for k in kept for x in vals[k]]


kept = [0, 3, 4, 8, 10, 11]
A = [1.0 + (j % 5) for j in range(T)]
print("cam values:", fmt(cam(kept, A)))
print("cam normalized:", fmt(cam(kept, A, normalize=True)))


# ---- kvpress PyramidKV schedule (PyramidKVPress.get_layer_budget) --------
def pyramid_kvpress(L, q_len, ratio, window=64, beta=20):
    out = []
    for layer in range(L):
        max_cap = window + q_len * (1 - ratio)
        mn = (max_cap - window) / beta
        mx = (max_cap - window) * 2 - mn
        if mx >= q_len - window:
            mx = q_len - window
            mn = (max_cap - window) * 2 - mx
        if not (q_len >= mx >= mn >= window):
            out.append(round(q_len * (1 - ratio)))
            continue
        steps = (mx - mn) / (L - 1)
        out.append(round(mx - layer * steps))
    return out


for L, q, r in [(30, 2048, 0.5), (30, 2048, 0.75), (30, 2048, 0.25), (4, 1000, 0.5), (30, 300, 0.5)]:
    print(f"pyramid_kvpress L={L} T={q} r={r}:", pyramid_kvpress(L, q, r))


# ---- ThinK: window 3 (queries Q used as post-RoPE), ratio 0.5 ------------
def think(window=3, ratio=0.5):
    qn = [sum(Q[i][h][c] ** 2 for h in range(HQ) for i in range(T - window, T)) / (HQ * window) for c in range(D)]
    kn = [sum(K[j][c] ** 2 for j in range(T)) / T for c in range(D)]
    score = [a * b for a, b in zip(qn, kn)]
    pruned = int(D * ratio)
    keep = sorted(sorted(range(D), key=lambda c: (-score[c], c))[: D - pruned])
    return score, keep


ts, tk = think()
print("think channel scores:", fmt(ts), "kept:", tk)


# ---- Quest: pages of 4, budget 8 rows; 12 prompt rows + the decode row ---
def quest(page=4, budget=8):
    rows = K + [K[0]]  # the decode step appends row 0's key again
    n = len(rows)
    q = [[0.3 - 0.17 * (h * D + c) for c in range(D)] for h in range(HQ)]
    pages = (n + page - 1) // page
    bounds = []
    for p in range(pages - 1):
        blk = rows[p * page:(p + 1) * page]
        lo = [min(r[c] for r in blk) for c in range(D)]
        hi = [max(r[c] for r in blk) for c in range(D)]
        bounds.append(max(sum(max(qh[c] * lo[c], qh[c] * hi[c]) for c in range(D)) for qh in q))
    room = (budget - (n - (pages - 1) * page)) // page
    top = sorted(sorted(range(pages - 1), key=lambda p: (-bounds[p], p))[:room] + [pages - 1])
    read = [r for p in top for r in range(p * page, min((p + 1) * page, n))]
    return bounds, read


qb, qr = quest()
print("quest bounds:", fmt(qb), "rows read:", qr)


# ---- KVzip: one pass over the whole context (sink 0 for the first chunk) --
def kvzip(n_sink=2, n=3):
    kp = [[math.cos(0.5 + 0.9 * i + 0.3 * c) for c in range(D)] for i in range(n)]
    qp = [[[math.sin(0.2 + 0.6 * i + 0.8 * c + 0.4 * h) for c in range(D)] for h in range(HQ)] for i in range(n)]
    best = [0.0] * T
    for i in range(n):
        for h in range(HQ):
            keys = K + kp[: i + 1]
            p = softmax([sum(a * b for a, b in zip(qp[i][h], k)) / math.sqrt(D) for k in keys])
            for j in range(T):
                best[j] = max(best[j], p[j])
    score = [1.0 if j < n_sink else best[j] for j in range(T)]
    kept = sorted(sorted(range(T - 3), key=lambda j: (-score[j], j))[:3]) + [9, 10, 11]
    return score, kept


kz, kzk = kvzip()
print("kvzip scores:", fmt(kz))
print("kvzip kept (3 heavy + 3 recent):", kzk)
