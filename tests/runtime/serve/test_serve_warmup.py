"""Warm-up before ready (issue 37 item 3): ``/health`` (and every route) answers 503 "warming up" while the worker
runs LLM.warm_up, 200 once it has; ``xrun serve`` logs each warmed part and the total; ``--no-warm-up`` reports
ready without it. Tiny engine dir on the CPU (ONNX Runtime, EAGLE3 chain of 3), as test_serve.py."""

from __future__ import annotations

import re
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (pip install -e '.[serve]')")

import httpx2 as httpx  # noqa: E402
import serving  # noqa: E402

from xcompile.runtime.decoding.registry import DrafterSpec  # noqa: E402
from xcompile.runtime.serve.worker import EngineWorker, ServeConfig  # noqa: E402

ARGS = ("--backend", "ort", "--drafter", "eagle3", "--gamma", "3", "--device", "cpu")
SPEC = DrafterSpec("eagle3", 3)


class GatedWarmUp(EngineWorker):
    """The real worker, whose warm-up starts only once the test opens ``gate``."""

    gate = threading.Event()

    def warm_up(self) -> list:
        assert self.gate.wait(60), "test never opened the gate"
        return super().warm_up()


def completion(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0,
                                                          "return_token_ids": True},
                      timeout=60)


def test_health_is_503_warming_up_until_the_warm_up_ends(tiny_engine_dir):
    config = ServeConfig(str(tiny_engine_dir), "ort", "cpu", SPEC)
    s = serving.ThreadServer(config, open_worker=GatedWarmUp).start(wait=False)
    try:
        deadline = time.monotonic() + serving.START_TIMEOUT
        while (r := httpx.get(f"{s.url}/health", timeout=5)).json()["error"]["code"] != "warming_up":
            assert r.status_code == 503 and time.monotonic() < deadline, r.text     # loading, then warming up
            time.sleep(0.05)
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        assert completion(s.url).status_code == 503
        worker = s.scheduler.worker
        assert not worker.gen._executors                                    # nothing has run yet
        GatedWarmUp.gate.set()
        assert serving.wait_healthy(s.url)["status"] == "ok"
        # the rounds of both drafters (eagle3, plain) ran under greedy, sampling, top-p (+ the dir's config)
        assert len(worker.gen._executors) >= 6
        r = completion(s.url)
        want = serving.reference(tiny_engine_dir, [[5, 6, 7]], "ort", SPEC, 8)[0][0]
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
    finally:
        GatedWarmUp.gate.set()
        s.stop()


def test_a_server_without_warm_up_is_ready_at_once_and_answers_the_same(tiny_engine_dir):
    config = ServeConfig(str(tiny_engine_dir), "ort", "cpu", SPEC, warm_up=False)
    s = serving.ThreadServer(config).start()
    try:
        assert not s.scheduler.worker.gen._executors                        # no round has run
        r = completion(s.url)
        want = serving.reference(tiny_engine_dir, [[5, 6, 7]], "ort", SPEC, 8)[0][0]
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
    finally:
        s.stop()


def wait_for(server: serving.XrunServe, text: str) -> str:
    """The server's log once ``text`` is in it (the drain thread reads it behind the health check)."""
    deadline = time.monotonic() + 10
    while text not in server.log and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.log


@pytest.mark.parametrize("warm", [True, False])
def test_xrun_serve_logs_what_it_warmed_or_that_it_did_not(tiny_engine_dir, warm):
    s = serving.XrunServe(tiny_engine_dir, *ARGS, *(() if warm else ("--no-warm-up",))).start()
    try:
        log = wait_for(s, "serving ")
        if warm:
            assert re.search(r"warmed prompt passes of 65, 128\.\.129, 2\d\d tokens in \d+\.\d\d s", log), log
            for part in ("warmed prompt passes of 1..64 tokens in",
                         "warmed rounds (eagle3; plain, as near the cache's end), greedy in",
                         "warmed rounds (eagle3; plain, as near the cache's end), sampled, top-p in"):
                assert part in log, log
            assert "warm-up done in" in log and "skipped" not in log
            assert log.index("warm-up done in") < log.index("serving ")
        else:
            assert "warm-up skipped (--no-warm-up)" in log and "warmed " not in log, log
        assert completion(s.url).status_code == 200
    finally:
        s.stop()


def test_the_app_loads_anyios_backend_before_it_takes_a_request():
    """A streamed response runs in an anyio task group, and anyio imports its asyncio backend on first use: the
    app's startup makes that use, so the first request after ready does not pay for the import. A fresh
    interpreter, since this one has long imported it."""
    import subprocess
    import sys

    code = """
import asyncio, sys
from xcompile.runtime.serve.app import create_app
from xcompile.runtime.serve.worker import ServeConfig

def no_engines(config):
    raise RuntimeError("no engines in this test")

app = create_app(ServeConfig("unused"), open_worker=no_engines, on_load_error=lambda message: None)
BACKEND = "anyio._backends._asyncio"
before = BACKEND in sys.modules

async def start():
    async with app.router.lifespan_context(app):
        return BACKEND in sys.modules

print(before, asyncio.run(start()))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]
