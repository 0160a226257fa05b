"""``xrun serve DIR --ray --replicas 2`` on the CPU: a local Ray (the 2 cores of this machine), two
replicas of the app behind Ray Serve's proxy, one endpoint; the openai client gets the tokens and
text of ``xrun generate`` from it, and both replicas answer. About a minute on the 2-core CI machine
(Ray's own start-up is most of it); every wait is bounded."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

pytest.importorskip("ray.serve", reason="needs the serve-ray extra (pip install -e '.[serve-ray]')")
pytest.importorskip("openai", reason="needs the openai client (pip install -e '.[dev]')")

import httpx2 as httpx  # noqa: E402  (the HTTP client the openai package itself uses)
import openai  # noqa: E402
import serving  # noqa: E402
from serving import extra, generate_json  # noqa: E402

from xcompile.runtime.common.errors import EngineError  # noqa: E402

ARGS = ("--backend", "ort", "--device", "cpu", "--drafter", "eagle3", "--gamma", "3")
PROMPT, NEW = "the cat", 16


def test_a_signal_to_the_process_group_stops_it_within_ten_seconds(tiny_engine_dir):
    """What Ctrl-C in a terminal does: every process of the job (the server and the Ray it started) gets the
    signal at once. Runs before the module's server starts, so its Ray is the only one on the machine."""
    s = serving.XrunServe(tiny_engine_dir, *ARGS, "--ray", "--replicas", "1", port=serving.free_port(),
                          session=True).start(timeout=300)
    t0 = time.monotonic()
    os.killpg(s.proc.pid, signal.SIGTERM)
    assert s.proc.wait(30) == 0, s.log
    assert time.monotonic() - t0 < 10, s.log
    deadline = time.monotonic() + 20                   # and nothing of the job is left running
    while time.monotonic() < deadline:
        try:
            os.killpg(s.proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"processes of the job still run 20 s after the server exited:\n{s.log}")


@pytest.fixture(scope="module")
def ray_server(tiny_engine_dir):
    s = serving.XrunServe(tiny_engine_dir, *ARGS, "--ray", "--replicas", "2", port=serving.free_port())
    s.start(timeout=300)
    yield s
    assert s.stop(signal.SIGINT) == 0, s.log        # Ctrl-C: the app is deleted, the local Ray stops


async def replica_pids(url: str, seconds: float = 60.0) -> set[int]:
    """Process ids /health reports, from bursts of concurrent requests (Ray's router sends a request to
    the less busy of two replicas, so concurrent ones spread), until two are seen or time is up."""
    pids: set[int] = set()
    deadline = asyncio.get_running_loop().time() + seconds
    async with httpx.AsyncClient(timeout=30) as c:
        while len(pids) < 2 and asyncio.get_running_loop().time() < deadline:
            replies = await asyncio.gather(*(c.get(f"{url}/health") for _ in range(8)))
            pids |= {r.json()["pid"] for r in replies if r.status_code == 200}
    return pids


def test_two_replicas_answer_through_one_endpoint(tiny_engine_dir, ray_server):
    assert len(asyncio.run(replica_pids(ray_server.url))) == 2
    ref = generate_json(tiny_engine_dir, "--prompt", PROMPT, "--max-new-tokens", NEW, *ARGS[:2], *ARGS[4:])
    chat_ref = generate_json(tiny_engine_dir, "--chat", PROMPT, "--max-new-tokens", NEW, *ARGS[:2], *ARGS[4:])

    async def ask(c: openai.AsyncOpenAI, model: str, i: int):
        kw = dict(model=model, max_tokens=NEW, extra_body={"return_token_ids": True})
        if i % 2:
            r = await c.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
            return "chat", r.choices[0].message.content, extra(r.choices[0], "token_ids")
        parts = [ch.choices[0] async for ch in await c.completions.create(prompt=PROMPT, stream=True, **kw)]
        return "text", "".join(p.text for p in parts), sum((extra(p, "token_ids") for p in parts), [])

    async def eight():
        async with openai.AsyncOpenAI(base_url=f"{ray_server.url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as c:
            model = (await c.models.list()).data[0].id
            return await asyncio.wait_for(asyncio.gather(*(ask(c, model, i) for i in range(8))), 240)

    want = {"text": (ref["text"], ref["tokens"]), "chat": (chat_ref["text"], chat_ref["tokens"])}
    for kind, text, tokens in asyncio.run(eight()):
        assert (text, tokens) == want[kind], kind


def test_serve_run_arguments():
    from xcompile.runtime.decoding.registry import DrafterSpec
    from xcompile.runtime.serve.ray_app import deployment, parse

    config, replicas, scaling = parse({"engine_dir": "d", "backend": "trt", "gamma": "3", "max_queue": "8",
                                       "request_timeout": "2.5", "replicas": "4"})
    assert (config.engine_dir, config.backend, config.drafter, config.max_queue, config.request_timeout) == \
        ("d", "trt", DrafterSpec("auto", 3), 8, 2.5)
    assert (replicas, scaling) == (4, None)
    d = deployment(config, replicas, gpu=True)
    assert (d.num_replicas, d.ray_actor_options["num_gpus"], d.max_ongoing_requests, d.max_queued_requests) == \
        (4, 1, 9, 8)
    assert deployment(config, 2).ray_actor_options.get("num_gpus", 0) == 0
    _, _, scaling = parse({"engine_dir": "d", "min_replicas": "2", "max_replicas": "8"})
    assert scaling == {"min_replicas": 2, "max_replicas": 8, "target_ongoing_requests": 1}
    assert config.warm_up and not parse({"engine_dir": "d", "warm_up": "false"})[0].warm_up
    assert config.kv_cache_dtype == "auto"
    assert parse({"engine_dir": "d", "kv_cache_dtype": "fp8"})[0].kv_cache_dtype == "fp8"


@pytest.mark.parametrize("args, message", [
    ({"engine_dir": "x", "gammma": "3"}, "unknown argument\\(s\\) gammma; expected engine_dir=DIR"),
    ({"replicas": "2"}, "engine_dir=DIR is required"),
    ({"engine_dir": "x", "replicas": "two"}, "invalid literal"),
    ({"engine_dir": "x", "warm_up": "no"}, "expected true or false, got 'no'"),
    ({"engine_dir": "x", "gamma": "2", "tree_topk": "4"}, "--gamma sets a chain"),
    ({"engine_dir": "x", "kv_cache_dtype": "fp4"}, "--kv-cache-dtype 'fp4': expected one of auto, fp8"),
])
def test_serve_run_refuses_bad_arguments(args, message):
    from xcompile.runtime.serve.ray_app import parse

    with pytest.raises(EngineError, match=message):
        parse(args)
