"""Test helpers for the server (tests import this as ``serving``): an app on uvicorn in a thread, a real
``xrun serve`` subprocess, a worker whose target steps tests can hold or slow, and greedy references.

Every server listens on 127.0.0.1 on a port the OS picks; every wait is bounded.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself uses
import uvicorn

from xcompile.runtime.serve.app import create_app
from xcompile.runtime.serve.worker import EngineWorker, ServeConfig

START_TIMEOUT = 120         # s: a server is up (engines loaded) within this, or the test fails


def wait_healthy(url: str, timeout: float = START_TIMEOUT, headers: dict | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5, headers=headers)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


class ThreadServer:
    """``create_app(config, **kw)`` on uvicorn in a daemon thread of the test process."""

    def __init__(self, config: ServeConfig, **kw):
        self.app = create_app(config, **kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, wait: bool = True) -> ThreadServer:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        if wait:
            wait_healthy(self.url)
        return self

    @property
    def scheduler(self):
        return self.app.state.scheduler

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive(), "server did not shut down"


class XrunServe:
    """``xrun serve DIR ARGS --port 0`` as a subprocess; ``url`` from the port uvicorn reports."""

    def __init__(self, engine_dir: Path, *args: str, port: int = 0, session: bool = False):
        xrun = Path(sys.executable).with_name("xrun")           # the console script beside this interpreter
        self.cmd = [str(xrun), "serve", str(engine_dir), "--port", str(port), *args]
        self.session = session                                  # its own process group, as a terminal's job
        self.url = f"http://127.0.0.1:{port}" if port else None
        self.log = ""

    def start(self, timeout: float = START_TIMEOUT) -> XrunServe:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=self.session)
        deadline = time.monotonic() + timeout
        while self.url is None:                             # uvicorn: "Uvicorn running on http://127.0.0.1:PORT"
            line = self.proc.stdout.readline()
            self.log += line
            if m := re.search(r"running on (http://127\.0\.0\.1:\d+)", line):
                self.url = m.group(1)
            elif not line or time.monotonic() > deadline:
                raise RuntimeError(f"xrun serve did not start:\n{self.log}")
        threading.Thread(target=self._drain, daemon=True).start()
        wait_healthy(self.url, max(1.0, deadline - time.monotonic()))
        return self

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log += line

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)                          # SIGTERM: uvicorn shuts down, engines close
        return self.proc.wait(120)


class HeldWorker(EngineWorker):
    """The real worker; each target step first waits for ``gate`` (tests hold the device with it) and
    then sleeps ``delay`` seconds (a slower device), so queueing, cancel and timeouts are observable
    on a tiny model. ``entered`` is set once a step has started."""

    def __init__(self, config: ServeConfig):
        super().__init__(config)
        self.gate, self.entered, self.delay = threading.Event(), threading.Event(), 0.0
        self.gate.set()
        self.steps = 0
        target = self.target
        run = target.run

        def held_run(**inputs):
            self.entered.set()
            assert self.gate.wait(60), "test never opened the gate"
            time.sleep(self.delay)
            self.steps += 1
            return run(**inputs)

        target.run = held_run

    def warm_up(self) -> list:
        """The real warm-up (its steps pass the gate too); then the counters start from nothing."""
        parts = super().warm_up()
        self.entered.clear()
        self.steps = 0
        return parts


def generate_json(engine_dir: Path, *args) -> dict:
    """``xrun generate ... --json``, the reference every answer is held to."""
    from click.testing import CliRunner

    from xcompile.runtime.cli.xrun import main

    r = CliRunner().invoke(main, ["generate", str(engine_dir), "--device", "cpu", "--json", *map(str, args)])
    assert r.exit_code == 0, r.output
    return json.loads(r.output.strip().splitlines()[-1])


def extra(obj, name: str):
    """A field the OpenAI API does not define (``token_ids``, ``usage.xcompile``) from an openai object."""
    return (obj.model_extra or {}).get(name)


def free_port() -> int:
    """A port free on 127.0.0.1 now, for servers that cannot report the one they bound (Ray's proxy)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(engine_dir: Path, prompts: list, backend: str, spec, max_new_tokens: int, sampling=None,
              index: int = 0) -> list[tuple[list[int], str]]:
    """(tokens, text) of generation as ``xrun generate`` runs it (greedy unless ``sampling``; ``index``:
    the seed's stream), for each prompt (text, ids or a chat message list), on one engine set."""
    from xcompile.runtime.decoding.generator import Generator
    from xcompile.runtime.decoding.registry import make_drafter
    from xcompile.runtime.decoding.sampling import GREEDY
    from xcompile.runtime.enginedir.text import Text
    from xcompile.runtime.engines.load import open_engine_dir

    out = []
    with open_engine_dir(engine_dir, backend, "cpu") as es:
        text = Text(engine_dir)
        gen = Generator(es.engines["target"], make_drafter(es, spec), es.manifest.eos_token_ids,
                        es.manifest.max_seq_len, detokenize=text.decode)
        for p in prompts:
            ids = p if isinstance(p, list) and isinstance(p[0], int) else \
                text.chat(p) if isinstance(p, list) else text.encode(p)
            tokens = gen.generate(ids, max_new_tokens, sampling=sampling or GREEDY, index=index).tokens
            out.append((tokens, text.decode(tokens)))
    return out
