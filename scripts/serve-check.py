#!/usr/bin/env python3
"""Many sequences at once on one backend, from the binary.

Usage: serve-check.py MINIKV MODEL CONFIG

Starts `MINIKV serve` with CONFIG on a free loopback port, sends three
greedy completions together, then asks `MINIKV generate` for each prompt
alone with the same config. Passes (exit 0) when every completion is the
text `generate` gives alone, the cache held quantized codes (CONFIG's
residual must be shorter than a prompt's kept tokens and the new ones;
`scripts/gpu-check.sh` gives MiniKV a residual of 16) and the engine
decoded the requests together (fewer engine steps than one request after
another). `scripts/gpu-check.sh` runs it with `backend = "cuda"` on the
device; with `backend = "cuda-emulated"` it rehearses the same on the CPU
(`minikv-cli/tests/serve.rs` checks that in every test run).
"""
import json
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz combined movable metal type, oil-based ink and a wooden press adapted from wine making. Within fifty years presses were running in",
    "Rivers of Europe, from the longest to the shortest, are listed below with their sources, their mouths and the countries they cross on the way to the sea. The first of them, the Volga, rises in the hills northwest of",
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: once or twice she had peeped into the book her sister was reading, but it had no pictures or conversations in it, and",
]
NEW = 8


def complete(url, prompt, out, i):
    body = json.dumps({"prompt": prompt, "max_tokens": NEW, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out[i] = json.load(r)
    except Exception as e:  # reported with the request's prompt below
        out[i] = {"error": repr(e)}


def main():
    minikv, model, config = sys.argv[1:4]
    log = tempfile.TemporaryFile(mode="w+")
    srv = subprocess.Popen([minikv, "serve", "--model", model, "--config", config,
                            "--port", "0", "--kv-budget", "256MiB"],
                           stdout=subprocess.PIPE, stderr=log, text=True)
    answers = [None] * len(PROMPTS)
    steps = None
    try:
        line = srv.stdout.readline().strip()
        if not line.startswith("listening on "):
            srv.wait(timeout=30)
            log.seek(0)
            print(f"  serve did not start (exit {srv.returncode}): {log.read().strip()[-300:]}")
            return 1
        url = line[len("listening on "):]
        threads = [threading.Thread(target=complete, args=(url, p, answers, i))
                   for i, p in enumerate(PROMPTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            for m in r.read().decode().splitlines():
                if m.startswith("minikv_engine_steps_total "):
                    steps = int(m.split()[1])
    finally:
        srv.send_signal(signal.SIGTERM)
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
    ok = True
    for p, a in zip(PROMPTS, answers):
        g = subprocess.run([minikv, "generate", "--model", model, "--config", config,
                            "--prompt", p, "--max-tokens", str(NEW), "--json"],
                           capture_output=True, text=True)
        if g.returncode != 0 or "choices" not in (a or {}):
            print(f"  {p[:30]!r}: served {a}; generate exit {g.returncode}: {g.stderr.strip()[-200:]}")
            ok = False
            continue
        g = json.loads(g.stdout)
        alone, codes = g["text"], g["memory"]["quant_codes"]
        served = a["choices"][0]["text"]
        ok &= served == alone and codes > 0
        print(f"  {p[:30]!r}: served {served!r}, alone {alone!r}: same: {served == alone}; "
              f"{codes} bytes of codes (> 0: the fused decode read them)")
    serial = len(PROMPTS) * NEW
    together = steps is not None and steps < serial
    print(f"  {steps} engine steps for {len(PROMPTS)} requests of {NEW} tokens "
          f"({serial} one after another): decoded together: {together}")
    return 0 if ok and together else 1


if __name__ == "__main__":
    sys.exit(main())
