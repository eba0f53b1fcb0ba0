"""`quanta serve` end to end: the real server process on localhost with the default model on the CPU,
driven by the real `openai` client and by plain HTTP (httpx) with the OpenAI schema. Greedy outputs
are compared with the offline LLM.generate / LLM.chat result of the same model (the oracle).

The server runs with prefix caching on (its default), the oracle without: on the CPU a request's tokens
do not depend on blocks from the cache (a chat's system prompt) or on what ran beside it
(tests/test_batch_invariance.py), so they equal the oracle's exactly."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "test-key"
NAME = "smollm2"
MAX_MODEL_LEN = 512
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The best way to learn is",
           "My favourite colour is", "In the beginning", "Water boils at", "The quick brown fox"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    """Whether the server at `url` answers /health with 200; a refused connection (still starting) is False."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@contextlib.contextmanager
def _serving(model, *flags: str):
    """Run `quanta serve MODEL --device cpu FLAGS` on a free port; yields its base URL once healthy."""
    port = _free_port()
    cmd = [sys.executable, "-m", "quanta.cli.main", "-q", "serve", str(model), "--port", str(port),
           "--device", "cpu", *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):                       # bounded: up to a minute for the model to load
            if proc.poll() is not None:
                pytest.fail(f"quanta serve exited with {proc.returncode}: {' '.join(cmd)}")
            if _healthy(url):
                break
            time.sleep(0.25)
        else:
            pytest.fail("quanta serve did not become healthy")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def server(default_model_path):
    """Base URL of a running `quanta serve` with an API key (stopped after the module)."""
    with _serving(default_model_path, "--api-key", KEY, "--served-model-name", NAME,
                  "--max-model-len", str(MAX_MODEL_LEN)) as url:
        yield url


@pytest.fixture(scope="module")
def oracle(default_model_path):
    from quanta.engine import LLM
    return LLM(str(default_model_path), device="cpu", max_model_len=MAX_MODEL_LEN, quiet=True,
               enable_prefix_caching=False)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _greedy(oracle, prompts, max_tokens, **kw):
    from quanta.engine import SamplingParams
    outs = oracle.generate(list(prompts), SamplingParams(temperature=0, max_tokens=max_tokens, **kw), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return values


# --- the happy paths -----------------------------------------------------------------------------
def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server + "/health", timeout=5).json() == {"status": "ok"}      # no key needed
    version = httpx.get(server + "/version", headers={"Authorization": f"Bearer {KEY}"}, timeout=5).json()
    assert version["version"]


def test_completion_equals_offline(client, oracle):
    expected = _greedy(oracle, PROMPTS[:1], 16)[0]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text == expected.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.total_tokens == r.usage.prompt_tokens + 16
    assert r.usage.prompt_tokens == len(oracle.tokenizer(PROMPTS[0])["input_ids"])


def test_completion_batch_of_prompts_and_token_ids(client, oracle):
    expected = _greedy(oracle, PROMPTS[:3], 8)
    ids = oracle.tokenizer(PROMPTS[2])["input_ids"]
    r = client.completions.create(model=NAME, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [e.text for e in expected[:2]]
    r = client.completions.create(model=NAME, prompt=list(ids), max_tokens=8, temperature=0)
    assert r.choices[0].text == expected[2].text


def test_chat_equals_offline(client, oracle):
    from quanta.engine import SamplingParams
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = oracle.chat(messages, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.usage.completion_tokens == len(expected.token_ids)


def test_streaming_completion_and_chat(client, oracle):
    expected = _greedy(oracle, PROMPTS[1:2], 16)[0]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert len([c for c in chunks if c.choices]) > 1                 # it did stream
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    messages = [{"role": "user", "content": "Say hello."}]
    chat_full = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_full.choices[0].message.content
    assert all(c.usage is None for c in chunks)


def test_sse_ends_with_done(server):
    body = {"model": NAME, "prompt": PROMPTS[2], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_n_and_seed(client):
    kw = dict(model=NAME, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, n=2, seed=1234)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]        # seeded: reproducible
    assert a.choices[0].text != a.choices[1].text                            # two samples, not one twice
    assert 2 <= a.usage.completion_tokens <= 24
    streamed = list(client.completions.create(**(kw | {"stream": True})))
    texts = {0: "", 1: ""}
    for c in streamed:
        for ch in c.choices:
            texts[ch.index] += ch.text
    assert [texts[0], texts[1]] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]


def test_stop_string(client, oracle):
    expected = _greedy(oracle, PROMPTS[4:5], 24)[0].text
    words = expected.split()
    stop = words[len(words) // 2]                          # a word in the middle of the greedy output
    cut = expected[: expected.find(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=NAME, prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == cut         # the stop string is never streamed


def test_logprobs(client):
    r = client.completions.create(model=NAME, prompt=PROMPTS[5], max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 3 and max(top.values()) == pytest.approx(chosen, abs=1e-5)   # greedy: chosen is top
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
               for t in content)


def test_sampling_knobs_reach_the_engine(client, oracle):
    greedy = _greedy(oracle, PROMPTS[7:8], 10)[0].text
    top1 = client.completions.create(model=NAME, prompt=PROMPTS[7], max_tokens=10, temperature=1.0, seed=5,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy                     # top_k=1 leaves only the argmax
    penalized = client.completions.create(model=NAME, prompt=PROMPTS[7], max_tokens=10, temperature=0,
                                          frequency_penalty=2.0, presence_penalty=2.0,
                                          extra_body={"repetition_penalty": 1.5, "min_p": 0.05})
    expected = _greedy(oracle, PROMPTS[7:8], 10, frequency_penalty=2.0, presence_penalty=2.0,
                       repetition_penalty=1.5, min_p=0.05)[0].text
    assert penalized.choices[0].text == expected


def _wait_idle(server) -> dict[str, float]:
    for _ in range(100):                                   # aborts land at the next step
        after = _metrics(server)
        if after["quanta:num_requests_running"] == 0 and after["quanta:num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    return after


def test_client_timeout_aborts_a_whole_response(server):
    """A non-streamed request whose client gives up is aborted and its blocks freed."""
    before = _metrics(server)
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=1.5)
    after = _wait_idle(server)
    assert after["quanta:kv_cache_free_blocks"] == after["quanta:kv_cache_total_blocks"]
    key = 'quanta:request_success_total{finished_reason="abort"}'
    assert after[key] - before[key] == 1
    assert after["quanta:generation_tokens_total"] - before["quanta:generation_tokens_total"] < 400


# --- errors ---------------------------------------------------------------------------------------
def test_api_key(server, client):
    bad = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=NAME, prompt="x", max_tokens=1)
    for path in ("/v1/models", "/metrics", "/version"):
        r = httpx.get(server + path, timeout=5)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=1.5), dict(n=0), dict(max_tokens=0),
                                 dict(logprobs=50), dict(extra_body={"top_k": -5}),
                                 dict(presence_penalty=3), dict(extra_body={"min_p": 2})])
def test_out_of_range_is_400(client, bad):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="Hi", **({"max_tokens": 2} | bad))
    assert e.value.status_code == 400 and e.value.body["message"]


def test_other_errors(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=NAME, prompt=[1] * MAX_MODEL_LEN, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"reduce max_tokens to at most {MAX_MODEL_LEN - 10}"):
        client.completions.create(model=NAME, prompt=[1] * 10, max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[], max_tokens=2)
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for body in (b"{not json", b'{"prompt": 3}', b"[]"):
        r = httpx.post(server + "/v1/completions", content=body, headers=headers, timeout=10)
        assert r.status_code == 400, body
        assert set(r.json()["error"]) >= {"message", "type", "code"}
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).choices[0].text  # still serving


def test_return_token_ids_streams_every_token(server, oracle):
    """vLLM's return_token_ids: the streamed chunks carry the generated ids, which join to the offline greedy
    ids (a model without a tokenizer streams this way); the whole response carries them as well."""
    expected = _greedy(oracle, PROMPTS[5:6], 8)[0].token_ids
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": PROMPTS[5], "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    whole = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=60).json()
    assert whole["choices"][0]["token_ids"] == expected
    ids = []
    with httpx.stream("POST", server + "/v1/completions", json=body | {"stream": True}, headers=headers,
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ids += [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
    assert ids == expected


def test_plain_http_client(server, oracle):
    """A LangChain-style client: the OpenAI schema over plain HTTP, no SDK."""
    expected = _greedy(oracle, PROMPTS[6:7], 8)[0].text
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "prompt": PROMPTS[6], "max_tokens": 8, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json=body, headers=headers, timeout=60).json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == expected
    text = ""
    with httpx.stream("POST", server + "/v1/completions", json=body | {"stream": True}, headers=headers,
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == expected


# --- load ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("clients", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_concurrent_streams_with_disconnects(server, oracle, clients):
    """Streaming clients at once, every fourth hanging up after its first chunks: the rest equal the
    offline greedy result, the KV pool is all free afterwards and /metrics counted every request."""
    max_tokens = 12
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(clients)]
    expected = _greedy(oracle, prompts, max_tokens, ignore_eos=True)
    before = _metrics(server)
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(i: int, http: httpx.AsyncClient) -> str | None:
        body = {"model": NAME, "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, chunks = "", 0
        async with http.stream("POST", server + "/v1/completions", json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                chunks += 1
                if i % 4 == 3 and chunks == 2:
                    return None                            # hang up mid-stream
        return text

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(i, http) for i in range(clients)))

    texts = asyncio.run(run())
    for i, (text, exp) in enumerate(zip(texts, expected)):
        if i % 4 != 3:
            assert text == exp.text, i
    after = _wait_idle(server)
    assert after["quanta:kv_cache_free_blocks"] == after["quanta:kv_cache_total_blocks"]
    assert after["quanta:kv_cache_usage_perc"] == 0

    def delta(name):
        return after[name] - before.get(name, 0)
    assert delta('quanta:request_success_total{finished_reason="length"}') == clients - clients // 4
    assert delta('quanta:request_success_total{finished_reason="abort"}') == clients // 4
    assert delta("quanta:prompt_tokens_total") == sum(len(oracle.tokenizer(p)["input_ids"]) for p in prompts)
    generated = delta("quanta:generation_tokens_total")
    assert (clients - clients // 4) * max_tokens < generated < clients * max_tokens
    assert delta("quanta:e2e_request_latency_seconds_count") == clients
    assert delta("quanta:time_to_first_token_seconds_count") == clients


# --- the command line ------------------------------------------------------------------------------
def test_serve_command_line(tmp_path):
    from quanta.quant.errors import ConfigError
    from quanta.cli.main import build_parser
    from quanta.cli.serve import _chat_template
    args = build_parser().parse_args(["serve", "m.gguf", "--port", "9001", "--api-key", "k", "--served-model-name",
                                      "n", "--max-model-len", "256", "-q"])
    assert (args.model_path, args.port, args.api_key, args.served_model_name, args.max_model_len, args.quiet) == \
        ("m.gguf", 9001, "k", "n", 256, True)
    for bad in (["serve", "a.gguf", "--model", "b.gguf"], ["serve", "--port", "70000"]):
        with pytest.raises(ConfigError):
            args = build_parser().parse_args(bad)
            args.check(args)
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _chat_template(str(template)) == template.read_text()
    assert _chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ConfigError):
        _chat_template("no-such-file.jinja")


def test_preemption_under_a_small_kv_pool(default_model_path):
    """A pool too small for every request at once: sequences are preempted and recomputed, every
    request still completes in full, /metrics counts the preemptions and the pool ends all free."""
    with _serving(default_model_path, "--max-model-len", "96", "--block-size", "16",
                  "--num-kv-blocks", "6", "--schedule-conservativeness", "0") as url:
        body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        seeded = {"max_tokens": 40, "temperature": 0.8, "ignore_eos": True, "n": 2}

        async def run():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(http.post(url + "/v1/completions", json=body | {"prompt": p})
                                              for p in PROMPTS[:4]),
                                            *(http.post(url + "/v1/completions", json=seeded | {"prompt": p,
                                                                                               "seed": 7 + i})
                                              for i, p in enumerate(PROMPTS[4:6])))
        responses = [r.json() for r in asyncio.run(run())]
        assert all(r["usage"]["completion_tokens"] in (40, 80) for r in responses), responses
        # Seeded n = 2 gives the samples of the engine that never preempted (each sample its own generator).
        from quanta.engine import LLM, SamplingParams
        with LLM(str(default_model_path), device="cpu", max_model_len=96, quiet=True) as alone:
            for i, (prompt, served) in enumerate(zip(PROMPTS[4:6], responses[4:])):
                want = alone.generate(prompt, SamplingParams(n=2, seed=7 + i, temperature=0.8, max_tokens=40,
                                                             ignore_eos=True), use_tqdm=False)[0].outputs
                assert [c["text"] for c in sorted(served["choices"], key=lambda c: c["index"])] == \
                    [o.text for o in want]
        text = httpx.get(url + "/metrics", timeout=10).text
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line and not line.startswith("#") and "_bucket" not in line}
        assert values["quanta:num_preemptions_total"] > 0
        assert values["quanta:kv_cache_free_blocks"] == values["quanta:kv_cache_total_blocks"] == 6


def test_generate_and_chat_talk_to_a_running_server(server, oracle, capsys, monkeypatch):
    """`quanta generate --url` and `quanta chat --url` print what the offline engine gives, with --stats."""
    import io

    from quanta.engine import SamplingParams
    from quanta.cli.main import main
    expected = _greedy(oracle, ["The capital of France is"], 12)[0].text
    assert main(["-q", "generate", "--url", server, "--api-key", KEY, "The capital of France is",
                 "--max-tokens", "12", "--stats"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert re.search(r"prompt \d+ tokens, time to first token \d+ ms; 12 tokens", captured.err), captured.err
    question = "What is the capital of France?"
    reply = oracle.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0].text
    monkeypatch.setattr(sys, "stdin", io.StringIO(question + "\n"))
    assert main(["-q", "chat", "--url", server + "/v1", "--api-key", KEY, "--model", NAME, "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out == reply + "\n"


def test_generate_url_errors_are_clear(server, capsys):
    from quanta.cli.main import main
    assert main(["-q", "generate", "--url", server, "--api-key", "wrong", "hi"]) == 2
    assert "HTTP 401" in capsys.readouterr().err
    assert main(["-q", "generate", "--url", "http://127.0.0.1:9", "hi"]) == 2
    assert "cannot reach http://127.0.0.1:9/v1" in capsys.readouterr().err


# --- hostile input and engine faults -------------------------------------------------------------
def _latencies(url: str, seconds: float, out: list) -> None:
    """Time /health every 50 ms for `seconds` into `out`."""
    end = time.monotonic() + seconds
    with httpx.Client(timeout=5) as http:          # one connection: the client's own set-up is not timed
        while time.monotonic() < end:
            t0 = time.perf_counter()
            r = http.get(url + "/health")
            out.append((time.perf_counter() - t0, r.status_code))
            time.sleep(0.05)


def _during_a_huge_prompt(url: str, headers: dict) -> tuple[int, list, float]:
    """Send a 10 MB prompt; meanwhile time /health and a 4-token request. (its status, health times, short s)"""
    import threading
    short_request = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    # warm: a fresh server's first generation pays one-off start-up work that is not what is measured here
    assert httpx.post(url + "/v1/completions", json=short_request, headers=headers, timeout=60).status_code == 200
    huge = ("All work and no play makes Jack a dull boy. " * 240_000)[:10_000_000]
    body = json.dumps({"prompt": huge, "max_tokens": 1}).encode()      # encoded before the clock starts
    result = {}

    def send():
        result["status"] = httpx.post(url + "/v1/completions", content=body, timeout=120,
                                      headers=headers | {"content-type": "application/json"}).status_code
    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.3)
    health: list = []
    watcher = threading.Thread(target=_latencies, args=(url, 2.5, health))
    watcher.start()
    t0 = time.perf_counter()
    short = httpx.post(url + "/v1/completions", json=short_request, headers=headers, timeout=30)
    short_s = time.perf_counter() - t0
    assert short.status_code == 200, short.text
    watcher.join()
    sender.join()
    return result["status"], health, short_s


def _answered_at_once(health: list) -> bool:
    """Every /health answered 200, typically within 100 ms and never after 500 ms: an event loop blocked by the
    prompt's reading or tokenizing would hold them for seconds, while a busy 2-core machine may delay one poll."""
    times = sorted(t for t, _ in health)
    return all(code == 200 for _, code in health) and times[len(times) // 2] < 0.1 and times[-1] < 0.5


def test_a_10_mb_prompt_is_refused_at_once_and_holds_nothing_up(server):
    status, health, short_s = _during_a_huge_prompt(server, {"Authorization": f"Bearer {KEY}"})
    assert status == 413                                      # over the body limit the model's context implies
    assert _answered_at_once(health), health
    assert short_s < 2.0


def test_a_10_mb_prompt_being_tokenized_holds_nothing_up(default_model_path):
    """With limits raised so that the prompt is read and tokenized (then refused as longer than the context),
    the event loop still answers /health at once (_answered_at_once) and a short request completes within 2 s."""
    with _serving(default_model_path, "--max-model-len", "512", "--max-prompt-chars", "20000000",
                  "--max-request-bytes", "30000000") as url:
        status, health, short_s = _during_a_huge_prompt(url, {})
    assert status == 400
    assert _answered_at_once(health), health
    assert short_s < 2.0


def test_a_killed_engine_makes_the_server_answer_503_and_exit(default_model_path):
    """kill -9 of the engine process: /health and requests answer 503 at once and the server exits non-zero
    within seconds (so that a supervisor restarts it)."""
    import os
    import signal
    import psutil
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "quanta.cli.main", "-q", "serve", str(default_model_path),
                             "--port", str(port), "--device", "cpu", "--max-model-len", "256"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(240):
            if _healthy(url):
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.25)
        child = next(p for p in psutil.Process(proc.pid).children(recursive=True) if "resource_tracker" not in
                     " ".join(p.cmdline()))
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 2
        while _healthy(url) and time.monotonic() < deadline:
            time.sleep(0.05)
        codes = []
        with contextlib.suppress(httpx.TransportError):
            codes.append(httpx.get(url + "/health", timeout=2).status_code)
            codes.append(httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                    timeout=2).status_code)
        assert codes and set(codes) == {503}, codes
        code = proc.wait(timeout=10)
        assert code != 0 and "the engine stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_model_that_cannot_load_is_one_error_line(tmp_path):
    for _ in range(3):                        # the child's broken pipe raced the parent's error before
        out = subprocess.run([sys.executable, "-m", "quanta.cli.main", "serve", str(tmp_path / "missing.gguf"),
                              "--device", "cpu"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("quanta: error:") and "missing.gguf" in lines[0], out.stderr
