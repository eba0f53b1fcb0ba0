"""Soak test of `quanta serve`: the real server process on loopback, driven through its public HTTP
interface only for a given time, then checked for health, leaked KV blocks, memory and correctness.

    python benchmarks/soak.py --seconds 600 --out benchmarks/results/soak-cpu-DATE.json

The server runs the default model (SmolLM2-135M Q4_1) on the CPU with a small KV pool (--num-kv-blocks)
so that the concurrent clients oversubscribe it and sequences are preempted. Each client loops over a
random mix: greedy completions (whole and streamed, checked token for token against the offline
LLM.generate of the same model, the oracle, computed before the server starts), sampled chat and n=2
completions (checked for shape; a seeded n=2 completion must give the same samples every time it is sent,
preempted or not), streams the client drops after a few chunks, requests the client gives up on
(timeouts), prompts over max_model_len, malformed bodies (bad JSON, wrong types, out-of-range values),
hostile ones (lone surrogates, chat parts that are not text, n over --max-n, text over the prompt's
character limit, a body over the byte limit) and requests without the API key; each of the last four must
get its 4xx error body, and no request may get a 5xx.

Afterwards: /health answers 200, /metrics shows every KV block free, the server's resident memory (the
process tree's VmRSS, read from /proc) is within --rss-bound-mib of its baseline (taken after a warm-up,
so allocator pools that the first batches grow are in it), every greedy output equals the oracle token
for token and a last greedy request still does. Exit status 0 only when every check passes.

The server runs with prefix caching on (its default) and the oracle without: on the CPU a request's
tokens do not depend on what ran beside or before it -- batch composition, chunked prefill, a preemption
and its recompute, cached blocks (cpu/attention.py, cpu/matmul.py) -- so equality is
exact, with no tolerance for near ties.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import local_server  # noqa: E402

KEY, NAME = "soak-key", "soak"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "My favourite colour is", "In the beginning", "Water boils at", "The quick brown fox",
           "Write a haiku about the sea.", "List three prime numbers:", "import numpy as np\n",
           "Dear Sir or Madam,"]
GREEDY_MAX_TOKENS = (24, 48, 64)
MALFORMED = [b"{not json", b'{"prompt": 3}', b"[]", b'{"prompt": "x", "max_tokens": "many"}',
             b'{"prompt": "x", "temperature": "hot"}', b'{"prompt": "x", "n": 0}', b"\xff\xfe\x00",
             b'{"prompt": "x", "top_p": 7}', b'{"prompt": "x", "stream": "yes please"}']
MALFORMED_CHAT = [b'{"messages": "hi"}', b'{"messages": []}', b'{"messages": [{"role": 5}]}']
HOSTILE = [("/v1/completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}'),
           ("/v1/completions", b'{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}'),
           ("/v1/completions", b'{"prompt": "x", "n": 100000, "max_tokens": 1}'),
           ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
           ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": [1]}]}]}'),
           ("/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}')]
SEEDED_PROMPTS = 3                  # seeded n=2 requests repeat over a few (prompt, seed) pairs


# --- the server process -------------------------------------------------------------------------
def tree_rss(pid: int) -> int:
    """VmRSS bytes of `pid` and its descendants (a server that runs its engine in a child counts too)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, AttributeError):
            continue
    return total


def start_server(model: str, args) -> tuple[subprocess.Popen, str]:
    flags = ["--device", "cpu", "--api-key", KEY, "--served-model-name", NAME, "--max-model-len", str(args.max_model_len),
             "--block-size", "16", "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-seqs", str(args.max_num_seqs)]
    log = open(args.server_log, "w") if args.server_log else subprocess.DEVNULL
    return local_server.start(model, flags, log=log, ready_s=180)


def metrics(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return values


# --- the oracle -----------------------------------------------------------------------------------
def offline_oracle(model: str, max_model_len: int) -> dict[tuple[int, int], list[int]]:
    """{(prompt index, max_tokens): greedy token ids} from the offline engine."""
    from quanta.engine import LLM, SamplingParams
    llm = LLM(model, device="cpu", max_model_len=max_model_len, quiet=True, enable_prefix_caching=False)
    # A greedy output of max_tokens m is the first m tokens of the longest one (EOS ends both alike).
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max(GREEDY_MAX_TOKENS)), use_tqdm=False)
    llm.close()
    return {(i, m): o.outputs[0].token_ids[:m] for i, o in enumerate(outs) for m in GREEDY_MAX_TOKENS}


# --- the clients ----------------------------------------------------------------------------------
class Tally:
    def __init__(self):
        self.sent = self.completed = self.greedy_checked = 0
        self.outcomes: collections.Counter = collections.Counter()     # kind/outcome -> count
        self.errors: collections.Counter = collections.Counter()       # unexpected, by class
        self.mismatches: list[dict] = []
        self.seeded: dict[tuple, list[str]] = {}                        # (prompt, seed, max_tokens) -> samples
        self.seeded_checked = 0

    def error(self, kind: str, cls: str, detail: str = "") -> None:
        self.errors[f"{kind}: {cls}"] += 1
        if detail and sum(self.errors.values()) <= 20:
            print(f"  unexpected {kind}: {cls} {detail[:300]}", file=sys.stderr)


def sse_events(lines: list[str]) -> tuple[list[dict], bool]:
    """The JSON events of an SSE body and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            done = True
        else:
            events.append(json.loads(data))
    return events, done


def check_greedy(t: Tally, kind: str, key, ids: list[int], oracle) -> None:
    t.greedy_checked += 1
    want = oracle[key]
    if ids != want:
        at = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
        t.error(kind, "greedy_mismatch")
        t.mismatches.append({"prompt": key[0], "max_tokens": key[1], "first_diff": at,
                             "got_len": len(ids), "want_len": len(want)})


async def greedy(http, url, rng, t: Tally, oracle, stream: bool) -> None:
    kind = "greedy_stream" if stream else "greedy"
    i, m = rng.randrange(len(PROMPTS)), rng.choice(GREEDY_MAX_TOKENS)
    body = {"model": NAME, "prompt": PROMPTS[i], "max_tokens": m, "temperature": 0, "return_token_ids": True,
            "stream": stream}
    if not stream:
        r = await http.post(url + "/v1/completions", json=body, headers=AUTH, timeout=600)
        if r.status_code != 200:
            return t.error(kind, f"http_{r.status_code}", r.text)
        c = r.json()["choices"][0]
        if c["finish_reason"] not in ("stop", "length") or not isinstance(c["text"], str):
            return t.error(kind, "malformed_response", r.text)
        t.completed += 1
        return check_greedy(t, kind, (i, m), c["token_ids"], oracle)
    async with http.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=600) as r:
        if r.status_code != 200:
            return t.error(kind, f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
        events, done = sse_events([line async for line in r.aiter_lines()])
    if any("error" in e for e in events):
        return t.error(kind, "stream_error_event", json.dumps(events[-1]))
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    if not done or reasons not in (["stop"], ["length"]):
        return t.error(kind, "malformed_stream", f"done={done} reasons={reasons}")
    t.completed += 1
    check_greedy(t, kind, (i, m), [x for e in events for c in e["choices"] for x in c.get("token_ids", [])], oracle)


async def sampled(http, url, rng, t: Tally) -> None:
    """Sampled chat (whole or streamed) or an n=2 completion: well-formed, finished, with usage."""
    stream = rng.random() < 0.5
    if rng.random() < 0.5:
        kind, path = "chat", "/v1/chat/completions"
        body = {"model": NAME, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": rng.randint(8, 48), "temperature": 0.8, "seed": rng.randrange(1000), "stream": stream}
        n = 1
    else:
        kind, path, n = "n2", "/v1/completions", 2
        body = {"model": NAME, "prompt": rng.choice(PROMPTS), "n": 2, "max_tokens": rng.randint(8, 40),
                "temperature": 1.0, "top_p": 0.9, "stream": stream}
        if not stream and rng.random() < 0.5:          # seeded: the same samples every time
            i = rng.randrange(SEEDED_PROMPTS)
            kind = "n2_seeded"
            body |= {"prompt": PROMPTS[i], "seed": 1000 + i, "max_tokens": 32, "ignore_eos": True}
    if not stream:
        r = await http.post(url + path, json=body, headers=AUTH, timeout=600)
        if r.status_code != 200:
            return t.error(kind, f"http_{r.status_code}", r.text)
        j = r.json()
        ok = (len(j["choices"]) == n and all(c["finish_reason"] in ("stop", "length") for c in j["choices"])
              and j["usage"]["completion_tokens"] >= n)
        if not ok:
            return t.error(kind, "malformed_response", r.text)
        if kind == "n2_seeded":
            texts = [c["text"] for c in sorted(j["choices"], key=lambda c: c["index"])]
            first = t.seeded.setdefault((body["prompt"], body["seed"]), texts)
            t.seeded_checked += 1
            if texts != first:
                return t.error(kind, "seeded_samples_differ", json.dumps([first, texts]))
        t.completed += 1
        return
    async with http.stream("POST", url + path, json=body, headers=AUTH, timeout=600) as r:
        if r.status_code != 200:
            return t.error(kind, f"http_{r.status_code}")
        events, done = sse_events([line async for line in r.aiter_lines()])
    if any("error" in e for e in events):
        return t.error(kind, "stream_error_event", json.dumps(events[-1]))
    finished = {c["index"] for e in events for c in e["choices"] if c.get("finish_reason")}
    if not done or finished != set(range(n)):
        return t.error(kind, "malformed_stream", f"done={done} finished={finished}")
    t.completed += 1


async def disconnect(http, url, rng, t: Tally) -> None:
    """A stream the client drops after a few chunks."""
    body = {"model": NAME, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "temperature": 0.7,
            "ignore_eos": True, "stream": True}
    after = rng.randint(1, 8)
    async with http.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=600) as r:
        if r.status_code != 200:
            return t.error("disconnect", f"http_{r.status_code}")
        seen = 0
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= after:
                break
    t.outcomes["disconnect"] += 1


async def give_up(http, url, rng, t: Tally) -> None:
    """A whole response the client stops waiting for."""
    body = {"model": NAME, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "temperature": 0,
            "ignore_eos": True}
    try:
        r = await http.post(url + "/v1/completions", json=body, headers=AUTH, timeout=rng.uniform(0.3, 3.0))
    except httpx.TimeoutException:
        t.outcomes["timeout"] += 1
        return
    if r.status_code != 200:
        return t.error("timeout", f"http_{r.status_code}")
    t.completed += 1                                      # finished before the client gave up


async def refused(http, url, rng, t: Tally, max_model_len: int) -> None:
    """Oversized prompts and malformed bodies (400), a missing key (401): each must get its error body."""
    roll = rng.random()
    if roll < 0.35:
        kind, expect = "oversized", 400
        prompt = [rng.randrange(100, 1000) for _ in range(max_model_len + rng.randint(0, 50))] \
            if rng.random() < 0.5 else "lorem ipsum " * max_model_len
        r = await http.post(url + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 4},
                            headers=AUTH, timeout=60)
    elif roll < 0.6:
        kind, expect = "hostile", 400
        path, content = rng.choice(HOSTILE)
        r = await http.post(url + path, content=content, headers=AUTH | {"Content-Type": "application/json"},
                            timeout=60)
    elif roll < 0.7:                                        # a text past the character limit, then the body limit
        kind = "huge"
        big = rng.random() < 0.5
        prompt = "lorem ipsum " * (400_000 if big else max_model_len * 20)
        expect = 413 if big else 400
        r = await http.post(url + "/v1/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 4},
                            headers=AUTH, timeout=60)
    elif roll < 0.85:
        kind, expect = "malformed", 400
        chat = rng.random() < 0.25
        content = rng.choice(MALFORMED_CHAT if chat else MALFORMED)
        r = await http.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), content=content,
                            headers=AUTH | {"Content-Type": "application/json"}, timeout=60)
    else:
        kind, expect = "no_key", 401
        r = await http.post(url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2},
                            timeout=60)
    try:
        error = r.json()["error"]
        well_formed = {"message", "type", "code"} <= set(error) and error["code"] == r.status_code
    except (ValueError, KeyError, TypeError):
        well_formed = False
    if r.status_code != expect or not well_formed:
        return t.error(kind, f"http_{r.status_code}", r.text)
    t.outcomes[f"{kind}_{expect}"] += 1


async def client(url, seed: int, deadline: float, t: Tally, oracle, max_model_len: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            roll = rng.random()
            t.sent += 1
            kind = ("greedy" if roll < 0.3 else "greedy_stream" if roll < 0.5 else "sampled" if roll < 0.65
                    else "disconnect" if roll < 0.75 else "timeout" if roll < 0.82 else "refused")
            try:
                if kind in ("greedy", "greedy_stream"):
                    await greedy(http, url, rng, t, oracle, kind == "greedy_stream")
                elif kind == "sampled":
                    await sampled(http, url, rng, t)
                elif kind == "disconnect":
                    await disconnect(http, url, rng, t)
                elif kind == "timeout":
                    await give_up(http, url, rng, t)
                else:
                    await refused(http, url, rng, t, max_model_len)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                t.error(kind, type(e).__name__, repr(e))


# --- the run --------------------------------------------------------------------------------------
def soak(seconds: float, args) -> dict:
    """Run the soak; -> the figures and checks (see the module docstring)."""
    from quanta.cli.default_model import default_model_path
    model = str(args.model or default_model_path())
    t0 = time.monotonic()
    cache = Path(args.oracle_cache) if args.oracle_cache else None
    key = f"{Path(model).name}:{args.max_model_len}:{max(GREEDY_MAX_TOKENS)}"
    if cache is not None and cache.is_file() and json.loads(cache.read_text()).get("key") == key:
        oracle = {tuple(map(int, k.split(","))): v for k, v in json.loads(cache.read_text())["outputs"].items()}
    else:
        oracle = offline_oracle(model, args.max_model_len)
        if cache is not None:
            cache.write_text(json.dumps({"key": key, "outputs": {f"{i},{m}": v for (i, m), v in oracle.items()}}))
    print(f"oracle: {len(oracle)} greedy outputs in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    proc, url = start_server(model, args)
    print(f"server up after {time.monotonic() - t0:.0f} s", file=sys.stderr)
    try:
        t = Tally()
        warm = asyncio.run(_drive(url, 20.0, t, oracle, args, seed=10_000))   # allocator pools settle
        print(f"warm-up: {warm} requests; soaking {seconds:.0f} s", file=sys.stderr)
        base = metrics(url)
        rss_base = tree_rss(proc.pid)
        samples = [(0.0, rss_base)]
        t = Tally()

        async def sample_rss():
            start = time.monotonic()
            while True:
                await asyncio.sleep(30)
                samples.append((round(time.monotonic() - start), tree_rss(proc.pid)))
        started = time.monotonic()
        asyncio.run(_drive(url, seconds, t, oracle, args, seed=args.seed, sidecar=sample_rss))
        elapsed = time.monotonic() - started
        after = _wait_idle(url)
        final = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120, json={
            "model": NAME, "prompt": PROMPTS[0], "max_tokens": GREEDY_MAX_TOKENS[0], "temperature": 0,
            "return_token_ids": True}).json()["choices"][0]["token_ids"]
        health = httpx.get(url + "/health", timeout=10).status_code
        rss_after = tree_rss(proc.pid)
        alive = proc.poll() is None
    finally:
        local_server.stop(proc)
    leaked = int(after["quanta:kv_cache_total_blocks"] - after["quanta:kv_cache_free_blocks"])
    delta = rss_after - rss_base
    reasons = {k.split('"')[1]: int(v - base.get(k, 0)) for k, v in after.items()
               if k.startswith("quanta:request_success_total")}
    checks = {
        "healthy": health == 200 and alive,
        "no_leaked_blocks": leaked == 0,
        "idle_after": after["quanta:num_requests_running"] == 0 and after["quanta:num_requests_waiting"] == 0,
        "rss_within_bound": delta <= args.rss_bound_mib * 2**20,
        "no_unexpected_errors": not [k for k in t.errors if not k.endswith("greedy_mismatch")],
        "no_5xx": not [k for k in t.errors if re.search(r"http_5\d\d", k)],
        "seeded_n2_reproducible": t.seeded_checked > 0 and not [k for k in t.errors if "seeded" in k],
        "greedy_equal": t.greedy_checked > 0 and not t.mismatches,
        "final_request_equals_oracle": final == oracle[(0, GREEDY_MAX_TOKENS[0])],
        "preempted": after["quanta:num_preemptions_total"] > base["quanta:num_preemptions_total"],
    }
    return {
        "seconds": round(elapsed, 1), "model": Path(model).name, "warmup_requests": warm,
        "server": {"max_model_len": args.max_model_len, "num_kv_blocks": args.num_kv_blocks,
                   "max_num_seqs": args.max_num_seqs, "block_size": 16, "prefix_caching": True},
        "clients": args.clients,
        "requests_sent": t.sent, "requests_completed": t.completed, "greedy_checked": t.greedy_checked,
        "disconnects": t.outcomes["disconnect"], "timeouts": t.outcomes["timeout"],
        "refused_as_expected": {k: v for k, v in t.outcomes.items() if k not in ("disconnect", "timeout")},
        "preemptions": int(after["quanta:num_preemptions_total"] - base["quanta:num_preemptions_total"]),
        "server_finish_reasons": reasons,
        "generation_tokens": int(after["quanta:generation_tokens_total"] - base["quanta:generation_tokens_total"]),
        "unexpected_errors": {k: v for k, v in t.errors.items() if not k.endswith("greedy_mismatch")},
        "greedy_equal": t.greedy_checked - len(t.mismatches), "greedy_diverged": len(t.mismatches),
        "seeded_n2_checked": t.seeded_checked,
        "greedy_divergences": t.mismatches[:20],
        "leaked_blocks": leaked, "kv_blocks_total": int(after["quanta:kv_cache_total_blocks"]),
        "rss_baseline_mib": round(rss_base / 2**20, 1), "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_delta_mib": round(delta / 2**20, 1), "rss_bound_mib": args.rss_bound_mib,
        "rss_samples_mib": [(s, round(b / 2**20, 1)) for s, b in samples],
        "checks": checks, "passed": all(checks.values()),
    }


async def _drive(url, seconds, t: Tally, oracle, args, seed: int, sidecar=None) -> int:
    deadline = time.monotonic() + seconds
    side = asyncio.create_task(sidecar()) if sidecar else None
    await asyncio.gather(*(client(url, seed + k, deadline, t, oracle, args.max_model_len)
                           for k in range(args.clients)))
    if side:
        side.cancel()
    return t.sent


def _wait_idle(url: str) -> dict[str, float]:
    """Metrics once nothing runs or waits (aborts land at the next step), bounded at a minute."""
    for _ in range(120):
        m = metrics(url)
        if m["quanta:num_requests_running"] == 0 and m["quanta:num_requests_waiting"] == 0:
            return m
        time.sleep(0.5)
    return m


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M Q4_1")
    p.add_argument("--clients", type=int, default=8, help="concurrent client loops")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--num-kv-blocks", type=int, default=16, help="KV pool (16-token blocks): kept small so "
                   "the clients oversubscribe it")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--rss-bound-mib", type=float, default=64.0, help="allowed growth of the server's RSS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-log", default=None, help="write the server's output here")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--oracle-cache", default=None, help="keep the offline greedy outputs in this JSON file "
                   "(computed once per model and max_model_len)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = soak(args.seconds, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
