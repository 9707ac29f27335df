"""Table and KL curves of the kvpress cross-check (rows from kvpress_model.py).

Usage: kvpress_table.py ROWS.jsonl OUT.md IMG_DIR
"""

import collections
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows_path, out_md, img_dir = sys.argv[1:4]
rows = [json.loads(line) for line in open(rows_path) if line.strip()]
by = collections.defaultdict(list)
for r in rows:
    by[(r["method"], r["ratio"])].append(r)

ctx_files = sorted({r["context_file"] for r in rows})
lines = [
    "| method | ratio | " + " | ".join(f"{c}: kvpress / minikv KL" for c in ctx_files) + " | mean rel. diff | within 3% | note |",
    "|---|---|" + "---|" * len(ctx_files) + "---|---|---|",
]
summary = []
for (method, ratio), rs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
    cells, rels = [], []
    for c in ctx_files:
        r = next((x for x in rs if x["context_file"] == c), None)
        if r is None:
            cells.append("")
            continue
        a, b = r["kvpress_kl"], r["minikv_kl"]
        rel = abs(b - a) / max(a, 1e-12)
        rels.append(rel)
        cells.append(f"{a:.4f} / {b:.4f}")
    worst = max(rels) if rels else float("nan")
    mean = sum(rels) / len(rels) if rels else float("nan")
    ok = "yes" if worst <= 0.03 else "no"
    note = rs[0].get("note", "")
    summary.append((method, ratio, ok))
    lines.append(
        f"| {method} | {'-' if ratio is None else ratio} | " + " | ".join(cells) + f" | {100 * mean:.2f}% | {ok} | {note} |"
    )

os.makedirs(img_dir, exist_ok=True)
for c in ctx_files:
    fig, ax = plt.subplots(figsize=(9, 5))
    for (method, ratio), rs in sorted(by.items(), key=lambda kv: kv[0][0]):
        r = next((x for x in rs if x["context_file"] == c and (ratio in (0.5, None))), None)
        if r is None:
            continue
        (line,) = ax.plot(r["kvpress_kl_steps"], linestyle="--", linewidth=1)
        ax.plot(r["minikv_kl_steps"], color=line.get_color(), linewidth=1, label=method)
    ax.set_xlabel("decoded token (teacher-forced)")
    ax.set_ylabel("KL(full || compressed), nats")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title(f"{c}: minikv (solid) and kvpress (dashed), ratio 0.5")
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(os.path.join(img_dir, f"fidelity-kvpress-{c.split('.')[0]}.svg"))
    plt.close(fig)

r0 = rows[0]
table = (
    f"Context {r0['context']} tokens, {r0['tokens']} teacher-forced tokens, kvpress {r0['kvpress']}, "
    f"torch {r0['torch']}; {len(rows)} rows.\n\n" + "\n".join(lines) + "\n"
)
# The document keeps its prose; the table sits between two markers.
BEGIN, END = "<!-- xcheck table: begin -->\n", "<!-- xcheck table: end -->\n"
doc = open(out_md).read() if os.path.exists(out_md) else f"# minikv against kvpress\n\n{BEGIN}{END}"
if BEGIN not in doc or END not in doc:
    sys.exit(f"{out_md} has no table markers")
head, rest = doc.split(BEGIN, 1)
_, tail = rest.split(END, 1)
tmp = out_md + ".tmp"
with open(tmp, "w") as f:
    f.write(head + BEGIN + table + END + tail)
os.replace(tmp, out_md)
print("\n".join(lines))
print(f"table written to {out_md}; curves in {img_dir}")
