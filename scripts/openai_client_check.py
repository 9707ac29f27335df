"""Drives a running `minikv serve` with the official `openai` Python client:
completions, chat, streaming, logprobs, 64 concurrent streaming clients,
cancellation, and bad inputs. Greedy answers must equal `minikv generate`
with the same config. Exits non-zero, naming the check, on any failure.

Usage: python openai_client_check.py URL MINIKV_BINARY CONFIG
(scripts/openai-client-test.sh starts the server and calls this.)
"""

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import urllib.error
import openai

URL, BIN, CONFIG = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=600)
aclient = openai.AsyncOpenAI(base_url=URL + "/v1", api_key="unused", max_retries=0, timeout=600)
passed = []


def check(name, cond, detail=""):
    if not cond:
        print(f"FAIL {name}: {detail}", file=sys.stderr)
        sys.exit(1)
    passed.append(name)
    print(f"ok   {name}")


def generate(prompt, max_tokens, chat=False):
    args = [BIN, "generate", "--json", "--config", CONFIG, "--prompt", prompt, "--max-tokens", str(max_tokens)]
    if chat:
        args.append("--chat")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["text"]


def metric(name):
    text = urllib.request.urlopen(URL + "/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


model = client.models.list().data[0].id
check("models.list", bool(model), model)

prompt = "The three most important inventions of the nineteenth century were"
r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
want = generate(prompt, 24)
check("completion == minikv generate", r.choices[0].text == want, f"{r.choices[0].text!r} vs {want!r}")
usage = r.usage.model_dump()
check("usage carries kv bytes and ratio", usage.get("kv_bytes", 0) > 0 and 0 < usage.get("kv_ratio_to_fp16", 0), usage)

q = "Name three rivers in Europe."
c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0)
want = generate(q, 24, chat=True)
check("chat == minikv generate --chat", c.choices[0].message.content == want, f"{c.choices[0].message.content!r} vs {want!r}")

s = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
chunks = list(s)
text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
check("completion stream == whole", text == r.choices[0].text, f"{text!r}")
check("stream ends with usage", chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens, chunks[-1])

s = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=24, temperature=0, stream=True)
text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
check("chat stream == whole", text == c.choices[0].message.content, f"{text!r}")

r2 = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.8, top_p=0.9, seed=42)
r3 = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.8, top_p=0.9, seed=42)
check("seeded sampling reproduces", r2.choices[0].text == r3.choices[0].text)

r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stop=[" and"])
check("stop string", " and" not in r.choices[0].text and r.choices[0].finish_reason == "stop", r.choices[0])

r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
lp = r.choices[0].logprobs
check("completion logprobs", len(lp.tokens) == 4 and all(len(t) == 2 for t in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs), lp)
c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
content = c.choices[0].logprobs.content
check("chat logprobs", len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content), content)


async def concurrent(n):
    async def one(i):
        s = await aclient.completions.create(
            model=model, prompt=f"Story {i}: once upon a time", max_tokens=16, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for ch in s:
            if ch.choices:
                text += ch.choices[0].text
            if ch.usage:
                usage = ch.usage
        return i, text, usage

    return await asyncio.gather(*(one(i) for i in range(n)))


t0 = time.time()
steps0 = metric("minikv_engine_steps_total")
results = asyncio.run(concurrent(64))
dt = time.time() - t0
check("64 concurrent streaming clients", all(u is not None and u.completion_tokens == 16 for _, _, u in results), results[:2])
steps = metric("minikv_engine_steps_total") - steps0
check("they ran batched (fewer steps than sequential)", steps < 64 * 16, f"{steps} steps")
for i in (0, 17, 63):
    alone = client.completions.create(model=model, prompt=f"Story {i}: once upon a time", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    check(f"concurrent answer {i} == alone", results[i][1] == alone.choices[0].text, f"{results[i][1]!r} vs {alone.choices[0].text!r}")
print(f"     64 clients x 16 tokens in {dt:.1f} s ({64 * 16 / dt:.1f} tok/s, {steps:.0f} engine steps)")

cancelled0 = metric('minikv_requests_total{finish="cancelled"}')
with client.completions.with_streaming_response.create(
        model=model, prompt=prompt, max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True}) as resp:
    n = 0
    for line in resp.iter_lines():
        if line.startswith("data: "):
            n += 1
        if n >= 3:
            break
    check("a stream is running", metric("minikv_running_sequences") == 1.0)
deadline = time.time() + 10
while metric("minikv_running_sequences") != 0.0 and time.time() < deadline:
    time.sleep(0.05)
check("closing the stream cancels the sequence", metric("minikv_running_sequences") == 0.0 and metric("minikv_kv_bytes") == 0.0)
check("counted as cancelled", metric('minikv_requests_total{finish="cancelled"}') == cancelled0 + 1)


def bad(name, fn, status, text, param=None):
    try:
        fn()
    except openai.APIStatusError as e:
        body = e.response.json()["error"]
        ok = e.status_code == status and text in body["message"] and (param is None or body["param"] == param)
        check(f"bad input: {name}", ok, f"{e.status_code} {body}")
        return
    check(f"bad input: {name}", False, "no error")


bad("max_tokens=0", lambda: client.completions.create(model=model, prompt="x", max_tokens=0), 400, "max_tokens must be at least 1", "max_tokens")
bad("temperature=5", lambda: client.completions.create(model=model, prompt="x", temperature=5), 400, "temperature must be", "temperature")
bad("unknown field", lambda: client.completions.create(model=model, prompt="x", extra_body={"bogus": 1}), 400, "bogus", "bogus")
bad("prompt past the context", lambda: client.completions.create(model=model, prompt="a " * 9000, max_tokens=4), 400, "maximum context length")
bad("max_tokens past the context", lambda: client.completions.create(model=model, prompt="x", max_tokens=100000), 400, "maximum context length", "max_tokens")
bad("unknown role", lambda: client.chat.completions.create(model=model, messages=[{"role": "wizard", "content": "x"}]), 400, "unsupported role")
bad("n=2", lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], n=2), 400, "n must be 1", "n")
def raw(body):
    req = urllib.request.Request(URL + "/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


st, v = raw(b'{"prompt": "x"')
check("bad input: malformed JSON", st == 400 and "EOF while parsing" in v["error"]["message"], v)
st, v = raw(b'{"prompt": "\xff"}')
check("bad input: bad UTF-8", st == 400 and "UTF-8" in v["error"]["message"], v)
st, v = raw(b" " * (5 << 20))
check("bad input: oversized body", st == 413 and "larger than" in v["error"]["message"], v)
check("still healthy", json.loads(urllib.request.urlopen(URL + "/health").read())["status"] == "ok")

print(f"all {len(passed)} checks passed")
