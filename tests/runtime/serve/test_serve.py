"""``xrun serve`` on the tiny engine dir (CPU, ONNX Runtime, EAGLE3 chain of 3).

The official ``openai`` client gets exactly the tokens and text ``xrun generate`` prints, streaming or
not; 16 concurrent clients all get their own complete answers; the queue limit answers 429; a client
that leaves frees the device within a round; a request past its timeout ends with an error; bad
requests get OpenAI-style 4xx JSON; /metrics counts what happened. Servers listen on 127.0.0.1 on
ports the OS picks; every wait and request loop is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import json
import signal
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (pip install -e '.[serve]')")
pytest.importorskip("openai", reason="needs the openai client (pip install -e '.[dev]')")

import httpx2 as httpx  # noqa: E402  (the HTTP client the openai package itself uses)
import openai  # noqa: E402
import serving  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from serving import extra, generate_json  # noqa: E402

from xcompile.runtime.decoding.registry import DrafterSpec  # noqa: E402
from xcompile.runtime.decoding.sampling import SamplingParams  # noqa: E402
from xcompile.runtime.serve.worker import EngineWorker, ServeConfig  # noqa: E402

ARGS = ("--backend", "ort", "--drafter", "eagle3", "--gamma", "3")
SPEC = DrafterSpec("eagle3", 3)
PROMPT, MESSAGE, NEW = "the cat", "hello there", 24
KEY = "test-key"
FINISH = {"max_tokens": "length", "max_seq_len": "length", "eos": "stop", "stop": "stop"}


@pytest.fixture(scope="module")
def server(tiny_engine_dir):
    """The real CLI: ``xrun serve DIR --backend ort --drafter eagle3 --gamma 3`` in a subprocess."""
    s = serving.XrunServe(tiny_engine_dir, *ARGS, "--device", "cpu", "--max-queue", "32").start()
    yield s
    # uvicorn shuts down on SIGTERM (engines closed), then the CLI reports the signal as every xcompile
    # command does: exit 143 = 128 + SIGTERM (runtime/common/interrupts.py)
    assert s.stop() == 128 + signal.SIGTERM, s.log
    assert "Application shutdown complete" in s.log and "Traceback" not in s.log, s.log


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    (m,) = client.models.list().data
    return m.id


# ---------------------------------------------------------------------------------------------
# the openai client sees what `xrun generate` prints


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_openai_client_gets_xrun_generate_output(tiny_engine_dir, client, model, chat, stream):
    ref = generate_json(tiny_engine_dir, *(("--chat", MESSAGE) if chat else ("--prompt", PROMPT)),
                        "--max-new-tokens", NEW, *ARGS)
    kw = dict(model=model, max_tokens=NEW, temperature=0, extra_body={"return_token_ids": True})
    if chat:
        create = lambda **k: client.chat.completions.create(messages=[{"role": "user", "content": MESSAGE}], **k)  # noqa: E731
    else:
        create = lambda **k: client.completions.create(prompt=PROMPT, **k)  # noqa: E731
    if stream:
        chunks = list(create(stream=True, stream_options={"include_usage": True}, **kw))
        choices = [c.choices[0] for c in chunks if c.choices]
        text = "".join((ch.delta.content or "") if chat else ch.text for ch in choices)
        tokens = sum((extra(ch, "token_ids") or [] for ch in choices), [])
        finish = [ch.finish_reason for ch in choices if ch.finish_reason]
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
        if chat:
            assert choices[0].delta.role == "assistant"
    else:
        r = create(**kw)
        (choice,) = r.choices
        text = choice.message.content if chat else choice.text
        tokens, finish, usage = extra(choice, "token_ids"), [choice.finish_reason], r.usage
    assert tokens == ref["tokens"] and text == ref["text"]
    assert finish == [FINISH[ref["stats"]["finish_reason"]]]
    s = ref["stats"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (s["prompt_tokens"], s["new_tokens"])
    assert usage.total_tokens == s["prompt_tokens"] + s["new_tokens"]
    x = extra(usage, "xcompile")
    assert (x["acceptance_length"], x["drafted"], x["accepted"], x["rounds"]) == \
        (s["acceptance_length"], s["drafted"], s["accepted"], s["rounds"])


def test_stop_string_ends_the_text_before_it(tiny_engine_dir, client, model):
    full = generate_json(tiny_engine_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, *ARGS)
    words = full["text"].split()
    assert len(words) >= 4, full["text"]
    stop = words[3]
    ref = generate_json(tiny_engine_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, "--stop", stop, *ARGS)
    for stream in (False, True):
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW, stop=[stop], stream=stream,
                                      extra_body={"return_token_ids": True})
        choices = [c.choices[0] for c in r] if stream else r.choices
        text = "".join(c.text for c in choices)
        tokens = sum((extra(c, "token_ids") for c in choices), [])
        # OpenAI's semantics: the text ends before the stop string; the ids keep the token that made it
        assert tokens == ref["tokens"] and text == ref["text"][:ref["text"].index(stop)]
        assert choices[-1].finish_reason == "stop" and stop not in text


def test_n_choices_and_several_prompts(tiny_engine_dir, client, model):
    prompts = [PROMPT, "a dog"]
    refs = serving.reference(tiny_engine_dir, prompts, "ort", SPEC, 8)
    r = client.completions.create(model=model, prompt=prompts, max_tokens=8, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [refs[0][1]] * 2 + [refs[1][1]] * 2     # greedy: n equal choices
    assert r.usage.completion_tokens == 2 * sum(len(t) for t, _ in refs)


def test_sampling_with_a_seed(tiny_engine_dir, client, model):
    """T > 0: choice j is stream j of the request's seed, as the Generator draws it; the same seed gives
    the same text again, and a seedless request reports the seed it drew, which reproduces it."""
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    refs = [serving.reference(tiny_engine_dir, [PROMPT], "ort", SPEC, 16, sampling, index=j)[0] for j in (0, 1)]
    assert refs[0] != refs[1]                       # two streams of one seed: different samples
    kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, n=2,
              extra_body={"top_k": 20, "return_token_ids": True})
    r = client.completions.create(**kw)
    assert [(extra(c, "token_ids"), c.text) for c in r.choices] == refs
    assert extra(r.usage, "xcompile")["seed"] == 1234
    parts = [ch.choices[0] for ch in client.completions.create(stream=True, **kw) if ch.choices]
    for j in (0, 1):
        mine = [p for p in parts if p.index == j]
        assert (sum((extra(p, "token_ids") for p in mine), []), "".join(p.text for p in mine)) == refs[j]
    unseeded = client.completions.create(**{**kw, "seed": None, "n": 1})
    seed = extra(unseeded.usage, "xcompile")["seed"]
    again = client.completions.create(**{**kw, "seed": seed, "n": 1})
    assert isinstance(seed, int) and extra(again.choices[0], "token_ids") == extra(unseeded.choices[0], "token_ids")


def test_curl_style_stream_wire_format(server, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and chunks[-1]["choices"][0]["finish_reason"]


# ---------------------------------------------------------------------------------------------
# concurrency


def test_sixteen_concurrent_clients_get_their_own_answers(tiny_engine_dir, server, model):
    prompts = [[5 + i, 17, 40 + 3 * i, 9, 100 - i][: 2 + i % 4] for i in range(16)]
    refs = serving.reference(tiny_engine_dir, prompts, "ort", SPEC, 12)

    async def one(c: openai.AsyncOpenAI, i: int):
        kw = dict(model=model, prompt=prompts[i], max_tokens=12, extra_body={"return_token_ids": True})
        if i % 2:
            parts = [ch.choices[0] async for ch in await c.completions.create(stream=True, **kw)]
            return "".join(p.text for p in parts), sum((extra(p, "token_ids") for p in parts), [])
        (choice,) = (await c.completions.create(**kw)).choices
        return choice.text, extra(choice, "token_ids")

    async def all16():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(16))), 180)

    start = time.monotonic()
    answers = asyncio.run(all16())
    assert [(tokens, text) for text, tokens in answers] == refs
    assert time.monotonic() - start < 180


# ---------------------------------------------------------------------------------------------
# bad requests


BAD = [
    (b"{not json", 400, "not valid JSON"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens: Input should be greater than or equal to 1"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "x", "n": 0}, 400, "n: Input should be greater than or equal to 1"),
    ({"prompt": "x", "stop": [""]}, 400, "stop strings must not be empty"),
    ({"prompt": "x", "stream": "sometimes"}, 400, "stream"),
    ({"prompt": "word " * 300}, 400, "exceed max_seq_len 256"),
    ({"prompt": "x" * 200_000}, 400, "a prompt of 200000 characters holds more than the 256 tokens"),   # untokenized
    ({"prompt": [1, 99999]}, 400, "token ids must lie in [0, 256)"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature: Input should be greater than or equal to 0"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p: Input should be greater than 0"),
    ({"prompt": "x", "temperature": 1, "seed": -5}, 400, "seed must be an integer in [0, 2**63)"),
    # no coercion between JSON types: a string for a number, a number for a bool, booleans as token ids
    ({"prompt": "x", "max_tokens": "4"}, 400, "max_tokens: Input should be a valid integer"),
    ({"prompt": "x", "stream": 1}, 400, "stream: Input should be a valid boolean"),
    ({"prompt": "x", "temperature": 1, "seed": 7.0}, 400, "seed: Input should be a valid integer"),
    ({"prompt": [True, False]}, 400, "prompt"),
    ({"prompt": "x", "temperature": 1e-45}, 400, "temperature must be 0 (greedy) or in [1e-05, 100]"),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature: Input should be a finite number"),
    (b'{"prompt": "x", "top_p": Infinity}', 400, "top_p: Input should be a finite number"),
    ({"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias: not implemented"),
    # greedy (no temperature): a sampling filter would change nothing, so it is refused, not ignored
    ({"prompt": "x", "top_k": 5}, 400, "top_k: greedy decoding (temperature unset or 0): it changes nothing"),
    ({"prompt": "x", "temperature": 0, "top_p": 0.5}, 400, "top_p: greedy decoding"),
    ({"prompt": "x", "min_p": 0.2}, 400, "min_p: greedy decoding"),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model 'gpt-9' not found"),
    ({}, 400, "prompt: Field required"),
]
BAD_CHAT = [
    ({"messages": [{"role": "user", "content": "x" * 200_000}]}, 400, "holds more than the 256 tokens"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, 400, "messages.0.foo: Extra inputs are not permitted"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "max_completion_tokens": 8}, 400,
     "max_tokens: 4 conflicts with max_completion_tokens 8"),
]


@pytest.mark.parametrize("route, body, status, message", [("completions", *b) for b in BAD] +
                         [("chat/completions", *b) for b in BAD_CHAT])
def test_bad_requests_get_openai_errors_and_the_server_stays_up(server, route, body, status, message):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(f"{server.url}/v1/{route}", timeout=30, **kw)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    if "must be" in message:                # SamplingParams' own checks name their field as the param too
        assert error["param"] == message.split()[0]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


BASE = {"completions": {"prompt": PROMPT, "max_tokens": 6, "return_token_ids": True},
        "chat/completions": {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 6,
                             "return_token_ids": True}}


@pytest.mark.parametrize("route, fields, param", [
    ("completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("completions", {"guided_regex": "[a-z]+"}, "guided_regex"),
    ("completions", {"guided_choice": ["yes", "no"]}, "guided_choice"),
    ("completions", {"guided_grammar": 'root ::= "a"'}, "guided_grammar"),
    ("completions", {"logprobs": 0}, "logprobs"),            # 0 asks for the sampled token's logprob
    ("completions", {"best_of": 2}, "best_of"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": " the end"}, "suffix"),
    ("completions", {"ignore_eos": True}, "ignore_eos"),
    ("completions", {"max_completion_tokens": 4}, "max_completion_tokens"),     # chat's field, unknown here
    ("completions", {"temprature": 0.7}, "temprature"),                         # a typo is not ignored either
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
])
def test_fields_not_implemented_are_refused_with_a_400_naming_them(server, route, fields, param):
    r = httpx.post(f"{server.url}/v1/{route}", json={**BASE[route], **fields}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ") and "leave it out" in error["message"]


@pytest.mark.parametrize("route, fields", [
    ("completions", {"repetition_penalty": 1.0, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {},
                     "logprobs": None, "best_of": 1, "echo": False, "suffix": None, "guided_json": None,
                     "ignore_eos": False, "skip_special_tokens": True, "user": "someone", "metadata": {"run": "7"},
                     "stream_options": {"include_usage": True}}),
    ("chat/completions", {"logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}, "tools": [],
                          "tool_choice": "none", "add_generation_prompt": True, "service_tier": "auto"}),
])
def test_fields_not_implemented_at_their_neutral_value_change_nothing(server, route, fields):
    plain = httpx.post(f"{server.url}/v1/{route}", json=BASE[route], timeout=60)
    r = httpx.post(f"{server.url}/v1/{route}", json={**BASE[route], **fields}, timeout=60)
    assert plain.status_code == 200 and r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("route, body, param", [
    ("completions", {"prompt": [5, 6, 7], "max_tokens": 254}, "max_tokens"),
    ("completions", {"prompt": [[5], [5, 6, 7]], "max_tokens": 254}, "max_tokens"),       # the longest prompt
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000},
     "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 256}, "max_tokens"),
])
def test_a_budget_past_the_context_is_refused_not_capped(server, route, body, param):
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "context_length_exceeded", "invalid_request_error")
    assert error["message"].startswith(f"{param} {body[param]} after a prompt of ")
    assert "context of 256 tokens" in error["message"] and "ask for at most" in error["message"]


def test_without_a_budget_chat_generates_to_the_context_end(held, worker, monkeypatch):
    """No max_tokens: chat stops where prompt + completion fill the context (finish_reason "length"), and a
    completion's default of 16 is capped at the room left; a budget that just fits is honoured."""
    monkeypatch.setattr(worker.gen, "eos_ids", frozenset())     # the tiny model's EOS comes early: ignore it
    with httpx.Client(base_url=held.url, headers=AUTH, timeout=120) as c:
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "the " * 230}]}).json()
        short = c.post("/v1/completions", json={"prompt": [5] * 245}).json()
        fits = c.post("/v1/completions", json={"prompt": [5] * 245, "max_tokens": 11}).json()
    usage = chat["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 256, usage
    assert chat["choices"][0]["finish_reason"] == "length"
    for r in (short, fits):
        assert r["usage"]["completion_tokens"] == 256 - 245 and r["choices"][0]["finish_reason"] == "length"


def test_ttft_counts_from_the_request_reaching_the_app(held, worker, monkeypatch):
    """The server's TTFT histogram starts when the request reaches the app, so a slow body's handling before
    the job exists (here a tokenizer that takes 0.3 s) is in it, not on the client's side of the clock."""
    encode = worker.encode
    monkeypatch.setattr(worker, "encode", lambda *a: time.sleep(0.3) or encode(*a))
    key = ("xcompile_time_to_first_token_seconds_sum", ())
    before = scrape_with(held.url, AUTH)
    with httpx.Client(base_url=held.url, headers=AUTH, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert scrape_with(held.url, AUTH)[key] - before.get(key, 0.0) >= 0.3


def test_unknown_route_and_method(server):
    r = httpx.get(f"{server.url}/v1/engines", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert httpx.post(f"{server.url}/health", timeout=30).status_code == 405


# ---------------------------------------------------------------------------------------------
# /metrics


def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of /metrics, through prometheus_client's own parser."""
    return scrape_with(url, {})


def scrape_with(url: str, headers: dict) -> dict[tuple, float]:
    """``scrape`` with request headers (a server with an API key)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_what_happened(server, client, model):
    before = scrape(server.url)
    got = lambda m, name, **labels: m.get((name, tuple(sorted(labels.items()))), 0.0)  # noqa: E731
    a = client.completions.create(model=model, prompt=PROMPT, max_tokens=10)
    parts = list(client.completions.create(model=model, prompt="a dog", max_tokens=7, stream=True,
                                           stream_options={"include_usage": True}))
    b = parts[-1].usage
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "n": 0}, timeout=30).status_code == 400
    after = scrape(server.url)
    delta = lambda name, **labels: got(after, name, **labels) - got(before, name, **labels)  # noqa: E731
    assert delta("xcompile_requests_total", route="/v1/completions", status="200") == 2
    assert delta("xcompile_requests_total", route="/v1/completions", status="400") == 1
    assert delta("xcompile_prompt_tokens_total") == a.usage.prompt_tokens + b.prompt_tokens
    assert delta("xcompile_generation_tokens_total") == a.usage.completion_tokens + b.completion_tokens
    xa, xb = extra(a.usage, "xcompile"), extra(b, "xcompile")
    assert delta("xcompile_draft_tokens_total") == xa["drafted"] + xb["drafted"]
    assert delta("xcompile_accepted_tokens_total") == xa["accepted"] + xb["accepted"]
    assert delta("xcompile_generations_total", reason="length") + delta("xcompile_generations_total",
                                                                        reason="stop") == 2
    for name in ("xcompile_time_to_first_token_seconds_count", "xcompile_acceptance_length_count",
                 "xcompile_time_per_output_token_seconds_count"):
        assert delta(name) == 2, name
    assert got(after, "xcompile_queue_depth") == 0 and got(after, "xcompile_requests_running") == 0


def test_the_heap_is_frozen_once_ready_and_collections_are_timed(tiny_engine_dir):
    """After the warm-up the server moves what it holds out of the collector's reach (scheduler.freeze_heap), and
    /metrics times every collection by generation; closing it gives the heap back to the collector."""
    s = serving.ThreadServer(ServeConfig(str(tiny_engine_dir), "ort", "cpu", SPEC)).start()
    try:
        assert gc.get_freeze_count() > 1000
        before = scrape(s.url)
        gc.collect()                        # the test's thread shares the server's process and its collector
        after = scrape(s.url)
        key = ("xcompile_gc_pause_seconds_count", (("generation", "2"),))
        assert after[key] >= before.get(key, 0.0) + 1
    finally:
        s.stop()
    assert gc.get_freeze_count() == 0


# ---------------------------------------------------------------------------------------------
# the device slot: queue limit, cancel on disconnect, timeouts (a worker whose steps tests hold or slow)


@pytest.fixture(scope="module")
def held(tiny_engine_dir):
    config = ServeConfig(str(tiny_engine_dir), "ort", "cpu", SPEC, api_key=KEY, max_queue=2)
    s = serving.ThreadServer(config, open_worker=serving.HeldWorker).start()
    yield s
    s.scheduler.worker.gate.set()
    s.stop()


@pytest.fixture
def worker(held):
    w = held.scheduler.worker
    w.gate.set()
    w.delay = 0.0
    yield w
    w.gate.set()


AUTH = {"authorization": f"Bearer {KEY}"}


async def until(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_full_queue_answers_429_and_the_server_stays_healthy(tiny_engine_dir, held, worker):
    prompts = [[7, 8, 9], [10, 11], [12, 13, 14, 15]]
    refs = serving.reference(tiny_engine_dir, prompts, "ort", SPEC, 6)
    body = lambda p: {"prompt": p, "max_tokens": 6, "return_token_ids": True}  # noqa: E731

    async def scenario():
        async with httpx.AsyncClient(base_url=held.url, headers=AUTH, timeout=60) as c:
            worker.gate.clear()
            worker.entered.clear()
            running = asyncio.create_task(c.post("/v1/completions", json=body(prompts[0])))
            await until(worker.entered.is_set)                      # the first holds the device
            queued = [asyncio.create_task(c.post("/v1/completions", json=body(p))) for p in prompts[1:]]
            await until(lambda: held.scheduler.waiting == 2)        # --max-queue 2: the queue is full
            over = await c.post("/v1/completions", json=body([1, 2]))
            health = await c.get("/health")
            worker.gate.set()
            return over, health, await asyncio.gather(running, *queued)

    over, health, done = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
    assert "--max-queue 2" in over.json()["error"]["message"]
    assert health.status_code == 200
    assert [r.status_code for r in done] == [200] * 3
    assert [r.json()["choices"][0]["token_ids"] for r in done] == [t for t, _ in refs]   # FIFO, nothing mixed


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_the_device(held, worker, stream, monkeypatch):
    worker.delay = 0.05                 # ~50 ms a target step: 200 tokens would hold the device for seconds
    monkeypatch.setattr(worker.gen, "eos_ids", frozenset())     # the tiny model's EOS comes early: ignore it
    long = {"prompt": [5, 6, 7], "max_tokens": 200, "stream": stream}
    steps = worker.steps
    with httpx.Client(base_url=held.url, headers=AUTH, timeout=60) as c:
        if stream:
            with c.stream("POST", "/v1/completions", json=long) as r:
                assert r.status_code == 200
                next(line for line in r.iter_lines() if line.startswith("data: {"))   # one chunk, then leave
        else:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=long, timeout=0.5)                     # give up waiting
        start = time.monotonic()
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
        took = time.monotonic() - start
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert took < 3.0, took             # it did not wait for the 200-token request
    assert worker.steps - steps < 60    # the abandoned request stopped early (200 tokens need 100+ steps)
    assert held.scheduler.waiting == 0 and not held.scheduler.slot.locked()


def test_api_key(held):
    body = {"prompt": [1, 2], "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.post(f"{held.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{held.url}/v1/models", timeout=30).status_code == 401
    assert httpx.post(f"{held.url}/v1/completions", json=body, headers=AUTH, timeout=30).status_code == 200
    assert httpx.get(f"{held.url}/health", timeout=30).status_code == 200        # probes need no key
    assert httpx.get(f"{held.url}/metrics", timeout=30).status_code == 200


@pytest.fixture(scope="module")
def slow(tiny_engine_dir):
    config = ServeConfig(str(tiny_engine_dir), "ort", "cpu", SPEC, max_queue=4, request_timeout=1.0)
    s = serving.ThreadServer(config, open_worker=serving.HeldWorker).start()
    s.scheduler.worker.delay = 0.05
    s.scheduler.worker.gen.eos_ids = frozenset()    # long requests stay long (the tiny model's EOS comes early)
    yield s
    s.scheduler.worker.gate.set()
    s.stop()


def test_a_request_past_its_timeout_ends_with_an_error(slow):
    long = {"prompt": [5, 6, 7], "max_tokens": 200}
    start = time.monotonic()
    r = httpx.post(f"{slow.url}/v1/completions", json=long, timeout=30)
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
    assert "--request-timeout 1.0" in r.json()["error"]["message"] and time.monotonic() - start < 3.0
    c = openai.OpenAI(base_url=f"{slow.url}/v1", api_key="x", max_retries=0, timeout=30)
    model = c.models.list().data[0].id
    with pytest.raises(openai.APIError, match="timed out"):
        for _ in c.completions.create(model=model, stream=True, **long):
            pass
    ok = httpx.post(f"{slow.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_a_queued_request_times_out_too(slow):
    w = slow.scheduler.worker

    async def scenario():
        async with httpx.AsyncClient(base_url=slow.url, timeout=30) as c:
            w.gate.clear()
            w.entered.clear()
            running = asyncio.create_task(c.post("/v1/completions", json={"prompt": [5], "max_tokens": 50}))
            await until(w.entered.is_set)
            queued = await c.post("/v1/completions", json={"prompt": [6], "max_tokens": 2})
            w.gate.set()
            return queued, await running

    queued, running = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert queued.status_code == 504 and "waiting for the device" in queued.json()["error"]["message"]
    assert running.status_code == 504


# ---------------------------------------------------------------------------------------------
# loading


def test_503_while_loading(tiny_engine_dir):
    import threading

    loaded = threading.Event()

    def slow_open(config):
        assert loaded.wait(60)
        return EngineWorker(config)

    s = serving.ThreadServer(ServeConfig(str(tiny_engine_dir), "ort", "cpu", SPEC), open_worker=slow_open)
    s.start(wait=False)
    try:
        for path in ("/health", "/v1/models"):
            r = httpx.get(f"{s.url}{path}", timeout=30)
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        loaded.set()
        assert serving.wait_healthy(s.url, 60)["backend"] == "ort"
    finally:
        loaded.set()
        s.stop()


def test_engines_that_fail_to_load_stop_xrun_serve_with_one_line(tiny_engine_dir, tmp_path):
    import shutil
    import subprocess

    broken = shutil.copytree(tiny_engine_dir, tmp_path / "broken")
    (broken / "target.onnx").write_bytes(b"not an onnx graph")
    s = serving.XrunServe(broken, *ARGS, "--device", "cpu")
    proc = subprocess.run(s.cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error:" in proc.stderr and "target.onnx" in proc.stderr.splitlines()[-1]


def test_a_tampered_dir_a_bad_host_or_a_port_in_use_stop_xrun_serve_before_it_listens(tiny_engine_dir, tmp_path):
    """Each is one error line before uvicorn starts or an engine loads (a tampered file was found by the load after
    "running on", and said twice; a port in use was uvicorn's exit 3 after the warm-up): exit 1, or 2 for an
    option the machine or backend cannot honour (--host, --row-invariant on a backend other than fast,
    --no-cuda-graphs on the CPU)."""
    import shutil
    import socket
    import subprocess

    tampered = shutil.copytree(tiny_engine_dir, tmp_path / "tampered")
    data = tampered / "target.onnx.data"
    data.write_bytes(b"X" * 8 + data.read_bytes()[8:])
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        for cmd, said, code in (
                (serving.XrunServe(tampered, *ARGS, "--device", "cpu").cmd, "target.onnx.data: bytes", 1),
                (serving.XrunServe(tiny_engine_dir, *ARGS, "--device", "cpu", "--host", "999.1.1.1").cmd,
                 "--host 999.1.1.1: not an address of this machine", 2),
                (serving.XrunServe(tiny_engine_dir, *ARGS, "--device", "cpu", port=taken).cmd,
                 f"--port {taken}: cannot listen there", 1),
                (serving.XrunServe(tiny_engine_dir, *ARGS, "--device", "cpu", "--row-invariant").cmd,
                 "--row-invariant chooses the fast backend's kernels", 2),
                (serving.XrunServe(tiny_engine_dir, *ARGS, "--device", "cpu", "--no-cuda-graphs").cmd,
                 "--no-cuda-graphs: steps on the CPU always run eagerly", 2),
                (serving.XrunServe(tiny_engine_dir, *ARGS, "--device", "cpu", "--kv-cache-dtype", "fp8").cmd,
                 "--kv-cache-dtype fp8: the ort backend", 2),
                (serving.XrunServe(tiny_engine_dir, "--backend", "ort", "--drafter", "mtp", "--device", "cpu").cmd,
                 "--drafter mtp: ", 2),
                (serving.XrunServe(tiny_engine_dir, "--backend", "ort", "--gamma", "300", "--device", "cpu").cmd,
                 "--gamma 300: a round verifies 301 tokens", 2),
                (serving.XrunServe(tiny_engine_dir, "--backend", "trt", "--device", "cpu").cmd,
                 "--backend trt: TensorRT engines run on a CUDA GPU", 2)):
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert proc.returncode == code and proc.stdout == "", proc.stdout + proc.stderr
            assert proc.stderr.startswith("error: ") and said in proc.stderr and len(proc.stderr.splitlines()) == 1, \
                proc.stderr


def test_a_server_with_an_fp8_cache_gives_xrun_generates_tokens(tiny_engine_dir):
    """--kv-cache-dtype fp8 reaches the worker's engines (the torch backend here): a greedy completion's tokens
    are those of ``xrun generate --kv-cache-dtype fp8`` on the same backend."""
    want = generate_json(tiny_engine_dir, "--prompt-ids", "5,6,7,8", "--max-new-tokens", 12, "--backend", "torch",
                         "--drafter", "eagle3", "--gamma", 3, "--kv-cache-dtype", "fp8")["tokens"]
    s = serving.ThreadServer(ServeConfig(str(tiny_engine_dir), "torch", "cpu", SPEC, kv_cache_dtype="fp8")).start()
    try:
        assert s.scheduler.worker.target.kv[0].dtype.itemsize == 1
        r = httpx.post(f"{s.url}/v1/completions", json={"model": s.scheduler.worker.model_name, "prompt": [5, 6, 7, 8],
                                                          "max_tokens": 12, "temperature": 0, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        s.stop()


def test_a_request_takes_no_thread_hop_and_the_engine_thread_gets_the_gil_back_soon(held, worker, monkeypatch):
    """The app's dependencies and exception handlers are async (FastAPI runs a plain def dependency, Starlette a
    plain def handler, on the thread pool: a hop a request that waits for the GIL while the engine thread holds
    it), for answers and refusals alike, and the serving process hands the GIL over every 0.5 ms at most
    (scheduler.SWITCH_INTERVAL), not Python's 5."""
    import sys

    import fastapi.dependencies.utils as deps
    import starlette._exception_handler as handlers

    from xcompile.runtime.serve.scheduler import SWITCH_INTERVAL

    hops = []

    def counting(pool):
        async def counted(func, *args, **kwargs):
            hops.append(func)
            return await pool(func, *args, **kwargs)
        return counted

    for module in (deps, handlers):
        monkeypatch.setattr(module, "run_in_threadpool", counting(module.run_in_threadpool))
    url = f"{held.url}/v1/completions"
    r = httpx.post(url, json={"prompt": [1, 2], "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 200 and hops == []
    for body, status in (({"model": "not-served", "prompt": [1], "max_tokens": 1}, 404),
                         ({"prompt": [1], "max_tokens": "two"}, 400), ({"prompt": [1], "best_of": 2}, 400)):
        r = httpx.post(url, json=body, headers=AUTH, timeout=30)
        assert (r.status_code, hops) == (status, []), r.text
    assert httpx.get(f"{held.url}/v1/nothing-here", headers=AUTH, timeout=30).status_code == 404 and hops == []
    assert sys.getswitchinterval() <= SWITCH_INTERVAL
