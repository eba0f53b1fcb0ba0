"""The server's safety and fault rules, in process (FastAPI app over a tiny random llama on the CPU, driven
through httpx's ASGI transport): the API key guards every route but /health; a request's `model` is only
compared with the served name, so paths in it are 404 and no file is opened (watched with an audit hook);
a request that fails alone (here: its text decoding raises) gets an error body or a stream error event
while the requests beside it complete with the tokens of the offline engine (the oracle)."""
from __future__ import annotations

import asyncio
import json
import logging
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from quanta.engine import LLM, SamplingParams  # noqa: E402
from quanta.engine.drivers.async_engine import AsyncEngine  # noqa: E402
from quanta.server.app import build_app  # noqa: E402
from test_engine_faults import PoisonedTokenizer  # noqa: E402

KEY, NAME = "sekrit", "tiny"
OPENED: list[str] | None = None          # paths opened while a test watches (see watch_opens)


def _audit(event: str, args) -> None:
    if OPENED is not None and event == "open" and isinstance(args[0], (str, bytes)):
        OPENED.append(str(args[0]))


sys.addaudithook(_audit)                 # cannot be removed; does nothing unless OPENED is a list


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import make_tiny_hf
    path = tmp_path_factory.mktemp("safety") / "llama"
    make_tiny_hf("llama", path)
    return str(path)


def llm(path) -> LLM:
    return LLM(path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=32, quiet=True,
               enable_prefix_caching=False)


def serve(offline: LLM, coro_fn):
    """Run `coro_fn(http)` against the app over `offline`'s core (API key KEY), the engine loop running
    (the LLM is held here: dropping it would close its core). As under uvicorn, an exception a handler
    turned into a 500 body is not raised again in the client."""
    engine = AsyncEngine(offline.core)
    app = build_app(engine, NAME, api_key=KEY)

    async def main():
        await engine.start()
        try:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                return await coro_fn(http)
        finally:
            await engine.stop()
    return asyncio.run(main())


ROUTES = [("GET", "/version", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
          ("POST", "/v1/completions", {"model": NAME, "prompt": [5, 6], "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 2})]


def test_the_api_key_guards_every_route_but_health(tiny):
    async def run(http):
        results = {}
        for method, path, body in ROUTES:
            for name, headers in [("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                                  ("no bearer", {"Authorization": KEY}),
                                  ("prefix", {"Authorization": f"Bearer {KEY}x"}),
                                  ("right", {"Authorization": f"Bearer {KEY}"})]:
                r = await http.request(method, path, json=body, headers=headers)
                results[(path, name)] = (r.status_code, r.json() if "json" in r.headers["content-type"] else r.text)
        results[("/health", "none")] = ((r := await http.get("/health")).status_code, r.json())
        return results
    results = serve(llm(tiny), run)
    for (path, name), (status, body) in results.items():
        if path == "/health":
            assert status == 200 and body == {"status": "ok"}
        elif name == "right":
            assert status == 200, (path, body)
        else:
            assert status == 401 and body["error"]["code"] == 401, (path, name, body)


def test_a_model_path_in_a_request_is_404_and_never_opened(tiny, tmp_path):
    global OPENED
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF not for you")
    names = ["../" * 8 + "etc/passwd", "/etc/passwd", str(secret), tiny, f"{tiny}/config.json",
             f"{NAME}/../{NAME}", f"../{NAME}", "file:///etc/passwd", NAME.upper(), f"{NAME} "]

    async def run(http):
        out = []
        for name in names:
            for path, body in (("/v1/completions", {"prompt": [5], "max_tokens": 1}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "max_tokens": 1})):
                r = await http.post(path, json=body | {"model": name}, headers={"Authorization": f"Bearer {KEY}"})
                out.append((name, r.status_code, r.json()))
        return out
    served = llm(tiny)
    OPENED = []
    try:
        results = serve(served, run)
        opened = list(OPENED)
    finally:
        OPENED = None
    for name, status, body in results:
        assert status == 404 and body["error"]["param"] == "model", (name, body)
        assert body["error"]["message"] == f"The model `{name}` does not exist."
    touched = [p for p in opened if "passwd" in p or "secret" in p or p.startswith(tiny)]
    assert not touched, touched


def test_a_request_failing_alone_gets_an_error_body_the_others_complete(tiny, caplog):
    """The tokenizer raises on one token that only prompt 0's greedy output holds: that request, whole,
    gets a 500 error body naming a request id (the failure's text is in the log only), and streamed, an error
    event then [DONE]; the requests beside it get the oracle's tokens and the server stays healthy."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 9], [44, 45, 46], [7] * 20]
    want = [o.outputs[0].token_ids for o in llm(tiny).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    poison = next(t for t in want[0] if t not in want[1] + want[2])
    served = llm(tiny)
    core = served.core
    core.tokenizer = PoisonedTokenizer(core.tokenizer, poison)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": NAME, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    async def whole(http, i):
        r = await http.post("/v1/completions", json=body | {"prompt": prompts[i]}, headers=auth, timeout=120)
        return r.status_code, r.json()

    async def streamed(http, i):
        r = await http.post("/v1/completions", json=body | {"prompt": prompts[i], "stream": True}, headers=auth,
                            timeout=120)
        return r.status_code, [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]

    async def run(http):
        results = await asyncio.gather(whole(http, 0), streamed(http, 0), whole(http, 1), streamed(http, 2))
        return results, (await http.get("/health")).status_code, (await whole(http, 1))
    with caplog.at_level(logging.ERROR):
        (bad_whole, bad_stream, good_whole, good_stream), health, after = serve(served, run)
    logged = "\n".join(f"{r.getMessage()} {r.exc_text}" for r in caplog.records)
    message = bad_whole[1]["error"]["message"]
    assert bad_whole[0] == 500 and "request id req-" in message and "poisoned" not in message
    assert message.split("request id ")[1].split(")")[0] in logged and "poisoned token" in logged
    status, events = bad_stream
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "request id req-" in error["message"] and "poisoned" not in error["message"]
    assert good_whole[0] == 200 and good_whole[1]["choices"][0]["token_ids"] == want[1]
    status, events = good_stream
    assert status == 200 and events[-1] == "[DONE]"
    assert [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c.get("token_ids", [])] == want[2]
    assert health == 200 and after[1]["choices"][0]["token_ids"] == want[1]
    assert core.pool.num_free == core.pool.num_blocks
