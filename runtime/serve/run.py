"""``xrun serve`` as functions: check the options, then serve on uvicorn, or as Ray Serve replicas."""

from __future__ import annotations

import logging
import os
import socket

from xcompile.runtime.common.errors import EngineError, OptionError
from xcompile.runtime.common.logs import logger
from xcompile.runtime.decoding.registry import check_spec
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.engines.load import pick_backend
from xcompile.runtime.engines.run_checks import (
    check_backend_options,
    check_cuda_graphs,
    check_row_invariant,
    resolve_device,
)
from xcompile.runtime.serve.worker import ServeConfig

log = logger(__name__)


def check(config: ServeConfig) -> None:
    """What can be checked before a port opens: the engine dir (its manifest, and its files' sizes and sampled
    blocks: tens of milliseconds), the device, the backend and what it can run, the drafter against the dir."""
    manifest = Manifest.load(config.engine_dir)
    manifest.verify(config.engine_dir, sorted(manifest.files))
    device = resolve_device(config.device)
    check_cuda_graphs(config.cuda_graphs, config.device)
    backend = pick_backend(manifest, config.backend, device)
    check_row_invariant(config.kernels(), backend)
    check_backend_options(backend, device, config.kv_cache_dtype)
    check_spec(config.drafter, config.engine_dir, manifest)


def serve_http(config: ServeConfig, host: str, port: int) -> None:
    """One process, one engine set, on uvicorn; returns on Ctrl-C / SIGTERM (engines closed), raises
    EngineError if the engines fail to load (the server stops then)."""
    import uvicorn

    from xcompile.runtime.serve.app import create_app

    check(config)
    sock = listen(host, port)       # before any engine loads: a port in use is one line, not uvicorn's exit 3
    failed: list[str] = []

    def on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started:                # uvicorn says where it runs only for sockets it binds itself
                name = sock.getsockname()
                where = f"[{name[0]}]" if ":" in name[0] else name[0]
                logging.getLogger("uvicorn.error").info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                                                        where, name[1])

    app = create_app(config, on_load_error=on_load_error)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    server.run(sockets=[sock])
    if failed:
        raise EngineError(failed[0])


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to serve on (port 0: a free one), or EngineError naming the option."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OptionError(f"--host {host}: not an address of this machine ({e.strerror}); give one such as "
                          "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)                   # uvicorn's backlog
    except OSError as e:
        sock.close()
        raise EngineError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); choose another --port "
                          "(0: any free one) or stop what holds it") from None
    return sock


STOP_SECONDS = 5     # how long Ray may take to delete the app and stop once asked (issue 37: stopped within 10 s)


def serve_ray(config: ServeConfig, host: str, port: int, replicas: int) -> None:
    """``replicas`` Ray Serve replicas behind Ray's proxy on host:port; blocks until Ctrl-C or SIGTERM,
    then deletes the application and shuts Ray down (a Ray started here stops with the process).

    Ctrl-C in a terminal signals the whole process group, which holds the Ray processes this one started:
    they are gone by the time the app would be deleted, and Ray's client then waits 60 s for them before it
    aborts the process. So the app is deployed, and later deleted, in a thread while this one only waits for a
    signal: the stop takes at most STOP_SECONDS, and what Ray has not finished by then is left behind (its
    processes got the signal too). The signal handlers are set after ray.init, which installs its own."""
    import dataclasses
    import signal
    import threading

    import ray
    from ray import serve

    from xcompile.runtime.serve.ray_app import NAME, deployment, uses_gpus

    check(config)
    stop, failed = threading.Event(), []
    ray.init()                      # joins the cluster RAY_ADDRESS names, else starts one on this machine
    gpu = uses_gpus(config)
    if gpu and config.device is None:
        config = dataclasses.replace(config, device="cuda")

    def start() -> None:
        try:
            serve.start(http_options={"host": host, "port": port})
            serve.run(deployment(config, replicas, gpu=gpu).bind(), name=NAME, route_prefix="/", blocking=False)
            log.info("serving %s on http://%s:%d with %d Ray Serve replica(s); Ctrl-C or SIGTERM stops",
                     config.engine_dir, host, port, replicas)
        except BaseException as e:  # noqa: BLE001 - reported below, after Ray is stopped
            failed.append(e)
            stop.set()

    def shut_down() -> None:
        try:
            serve.delete(NAME)
        finally:
            ray.shutdown()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    threading.Thread(target=start, daemon=True, name="ray-start").start()
    while not stop.wait(0.5):
        pass
    done = threading.Thread(target=shut_down, daemon=True, name="ray-stop")
    done.start()
    done.join(STOP_SECONDS)
    if done.is_alive():
        log.warning("Ray did not stop within %d s (its processes got the same signal, or the cluster is "
                    "unreachable); exiting without it", STOP_SECONDS)
        logging.shutdown()
        os._exit(1 if failed else 0)    # Ray's exit hooks would wait 60 s for processes that are gone
    if failed:
        raise EngineError(f"xrun serve --ray: Ray Serve did not start ({failed[0]!r})") from None
