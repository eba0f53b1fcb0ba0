"""The server under hostile input, in process (the app over a tiny random llama on the CPU through httpx's
ASGI transport): text that is not Unicode and chat parts that are not text are 400s naming the parameter;
the limits on samples, prompt characters and body bytes refuse a request before the work it would cost
(a prompt over the character limit never reaches the tokenizer); tokenizing runs off the event loop; a
failure inside the server is a 500 naming a request id whose traceback is in the log only; a stopped engine
makes /health and every request a 503 at once, /metrics says so, and the app reports the death once."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from quanta.engine import LLM  # noqa: E402
from quanta.engine.drivers.async_engine import AsyncEngine  # noqa: E402
from quanta.server.app import build_app  # noqa: E402
from quanta.server.limits import Limits, longest_token_chars  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_hf
    path = tmp_path_factory.mktemp("limits") / "llama"
    make_tiny_hf("llama", path)
    return str(path)


@pytest.fixture(scope="module")
def offline(tiny):
    return LLM(tiny, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32, quiet=True)


def serve(offline: LLM, coro_fn, limits: Limits = Limits(), on_death=None, lifespan: bool = False):
    """Run `coro_fn(http)` against the app over `offline`'s core; with `lifespan`, inside the app's lifespan
    (the engine started by it, the death watcher running), else with the engine started here."""
    engine = AsyncEngine(offline.core)
    app = build_app(engine, NAME, limits=limits, on_engine_death=on_death)

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            if lifespan:
                async with app.router.lifespan_context(app):
                    return await coro_fn(http)
            await engine.start()
            try:
                return await coro_fn(http)
            finally:
                await engine.stop()
    return asyncio.run(main())


def post(http, path: str, body, **kw):
    content = json.dumps(body) if isinstance(body, (dict, list)) else body
    return http.post(path, content=content, headers={"content-type": "application/json"} | kw.pop("headers", {}),
                     timeout=60, **kw)


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "\\ud800abc", "max_tokens": 2}', "prompt"),
    ('{"prompt": ["fine", "\\udfffx"], "max_tokens": 2}', "prompt.1"),
    ('{"prompt": "x", "stop": "\\ud83d", "max_tokens": 2}', "stop"),
    ('{"messages": [{"role": "user", "content": "a\\udc00"}]}', "messages.0.content"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', "messages.0.content.0.text"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}', "messages.0.content.0.text"),
    ('{"messages": [{"role": "user", "content": [{"type": "text"}]}]}', "messages.0.content.0"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "messages.0.content.0"),
])
def test_text_that_is_not_unicode_and_parts_that_are_not_text_are_400(offline, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"

    async def run(http):
        return [await post(http, path, body) for _ in range(2)] + [await http.get("/health")]
    first, again, health = serve(offline, run)
    for r in (first, again):                       # the same answer twice: nothing was left half-done
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "Error" not in error["message"], error
    assert health.status_code == 200


def test_a_text_part_list_is_joined(offline):
    async def run(http):
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text",
                                                                                          "text": "lo"}]}],
                "max_tokens": 2, "temperature": 0}
        return await post(http, "/v1/chat/completions", body)
    assert serve(offline, run).status_code == 200


def test_samples_over_max_n_are_refused(offline):
    async def run(http):
        return [await post(http, "/v1/completions", {"prompt": p, "n": n, "max_tokens": 1})
                for p, n in [("x", 5), ([[5, 6], [7, 8]], 3), ([[5, 6], [7, 8]], 2), ("x", 100_000)]] + \
               [await post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5,
                                                          "max_tokens": 1})]
    over, over_prompts, fits, huge, chat = serve(offline, run, Limits(max_n=4))
    for r in (over, over_prompts, huge, chat):
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "--max-n" in r.json()["error"]["message"]
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 4


def test_the_default_character_limit_follows_from_max_model_len(offline):
    engine = AsyncEngine(offline.core)
    limits = Limits().for_model(engine.tokenizer, engine.max_model_len)
    longest = max(len(t) for t in engine.tokenizer.get_vocab())
    assert longest_token_chars(engine.tokenizer) == longest
    assert limits.max_prompt_chars == 128 * longest
    assert limits.max_request_bytes >= 12 * limits.max_prompt_chars


class Watched:
    """A tokenizer that counts its calls, taking `delay` seconds (without the GIL, as the real one) each; `started`
    is set when a call begins."""

    def __init__(self, tokenizer, delay: float = 0.0):
        self.tokenizer, self.delay, self.calls, self.threads = tokenizer, delay, 0, set()
        self.started = threading.Event()

    def __call__(self, text, **kw):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        self.started.set()
        time.sleep(self.delay)
        return self.tokenizer(text, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_prompt_over_the_character_limit_is_refused_untokenized(offline):
    async def run(http):
        serving_tokenizer = Watched(offline.tokenizer)
        app_tok_swap(http, serving_tokenizer)
        long = await post(http, "/v1/completions", {"prompt": "a" * 1001, "max_tokens": 1})
        chat = await post(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": "b" * 600},
                                                                      {"role": "user", "content": "c" * 600}]})
        ok = await post(http, "/v1/completions", {"prompt": "a" * 100, "max_tokens": 1})
        return long, chat, ok, serving_tokenizer.calls
    long, chat, ok, calls = serve(offline, run, Limits(max_prompt_chars=1000))
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    assert "1,001 characters" in long.json()["error"]["message"] and "--max-prompt-chars" in long.json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert ok.status_code == 200 and calls == 1


def app_tok_swap(http, tokenizer) -> None:
    """Give the app's Serving `tokenizer` (the app is the transport's)."""
    app = http._transport.app
    serving = next(r.endpoint for r in app.routes if getattr(r, "path", "") == "/v1/completions").__closure__
    next(c.cell_contents for c in serving if type(c.cell_contents).__name__ == "Serving").tokenizer = tokenizer


def test_tokenizing_runs_off_the_event_loop(offline):
    """A prompt that takes 1.5 s to tokenize: /health and a token-id request answer meanwhile."""
    async def run(http):
        tok = Watched(offline.tokenizer, delay=1.5)
        app_tok_swap(http, tok)
        slow = asyncio.create_task(post(http, "/v1/completions", {"prompt": "slow text", "max_tokens": 1}))
        while not tok.started.is_set():                   # the slow tokenization is under way
            await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        health = await http.get("/health")
        t_health = time.perf_counter() - t0
        quick = await post(http, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        t_quick = time.perf_counter() - t0
        return health.status_code, t_health, quick.status_code, t_quick, (await slow).status_code, tok.threads
    health, t_health, quick, t_quick, slow, threads = serve(offline, run)
    assert health == 200 and t_health < 0.1
    assert quick == 200 and t_quick < 1.0
    assert slow == 200 and all(t.startswith("quanta-tokenize") for t in threads)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_body_over_the_byte_limit_is_413(offline, chunked):
    body = json.dumps({"prompt": "a" * 5000, "max_tokens": 1}).encode()

    async def chunks():
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]

    async def run(http):
        big = await post(http, "/v1/completions", chunks() if chunked else body)
        small = await post(http, "/v1/completions", {"prompt": "a", "max_tokens": 1})
        return big, small
    big, small = serve(offline, run, Limits(max_request_bytes=4096))
    assert big.status_code == 413, big.text
    assert big.json()["error"]["param"] == "body" and "4,096 bytes" in big.json()["error"]["message"]
    assert small.status_code == 200


def test_a_failure_inside_the_server_is_a_500_with_a_request_id_and_no_exception_text(offline, caplog):
    class Broken(Watched):
        def __call__(self, text, **kw):
            raise ValueError("secret internals of the tokenizer")

    async def run(http):
        app_tok_swap(http, Broken(offline.tokenizer))
        r1 = await post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        r2 = await post(http, "/v1/completions", {"prompt": "hi", "max_tokens": 1})   # same keep-alive client
        return r1, r2, await http.get("/health")
    with caplog.at_level(logging.ERROR):
        r1, r2, health = serve(offline, run)
    for r in (r1, r2):
        assert r.status_code == 500
        message = r.json()["error"]["message"]
        rid = r.headers["x-request-id"]
        assert rid in message and "secret" not in message and "ValueError" not in message
        assert any(rid in rec.getMessage() and "secret internals" in rec.exc_text for rec in caplog.records
                   if rec.exc_text)
    assert r1.headers["x-request-id"] != r2.headers["x-request-id"] and health.status_code == 200


def test_a_stopped_engine_is_503_everywhere_and_reported_once(tiny):
    """The engine loop dies on its next step: the request in flight, /health and new requests get 503 at once,
    /metrics shows the engine down, and the app calls on_engine_death once."""
    offline = LLM(tiny, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32, quiet=True)
    deaths = []

    def broken_step(*_a, **_kw):
        raise RuntimeError("the device fell off the bus")
    offline.core.step = broken_step

    async def run(http):
        first = await post(http, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
        await asyncio.sleep(0.6)                              # the watcher's turn
        t0 = time.perf_counter()
        health = await http.get("/health")
        again = await post(http, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4})
        stream = await post(http, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4, "stream": True})
        elapsed = time.perf_counter() - t0
        metrics = (await http.get("/metrics")).text
        return first, health, again, stream, elapsed, metrics
    first, health, again, stream, elapsed, metrics = serve(offline, run, on_death=lambda: deaths.append(1),
                                                           lifespan=True)
    for r in (first, health, again, stream):
        assert r.status_code == 503, r.text
        assert "the engine" in r.json()["error"]["message"]
    assert elapsed < 1.0 and deaths == [1]
    assert 'quanta:engine_healthy{model_name="tiny"} 0' in metrics
    assert 'quanta:num_requests_running{model_name="tiny"} 0' in metrics
