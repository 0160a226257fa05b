"""``xrun serve`` as functions: check the options, then serve on uvicorn, or as Ray Serve replicas."""

from __future__ import annotations

import torch

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.enginedir.manifest import Manifest
from xcompile.runtime.engines.load import pick_backend
from xcompile.runtime.serve.scheduler import ServeConfig


def check(config: ServeConfig) -> None:
    """What can be checked before a port opens: the engine dir, the device, the backend's name."""
    manifest = Manifest.load(config.engine_dir)
    if config.device == "cuda" and not torch.cuda.is_available():
        raise EngineError("--device cuda: no CUDA device is visible to torch here; use --device cpu")
    if config.device is not None:
        pick_backend(manifest, config.backend, torch.device(config.device))


def serve_http(config: ServeConfig, host: str, port: int) -> None:
    """One process, one engine set, on uvicorn; returns on Ctrl-C / SIGTERM (engines closed), raises
    EngineError if the engines fail to load (the server stops then)."""
    import uvicorn

    from xcompile.runtime.serve.app import create_app

    check(config)
    failed: list[str] = []

    def on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    app = create_app(config, on_load_error=on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    server.run()
    if failed:
        raise EngineError(failed[0])


def serve_ray(config: ServeConfig, host: str, port: int, replicas: int) -> None:
    """``replicas`` Ray Serve replicas behind Ray's proxy on host:port; blocks until Ctrl-C or SIGTERM,
    then deletes the application (a Ray started here stops with the process)."""
    import dataclasses
    import signal

    import ray
    from ray import serve

    from xcompile.runtime.serve.ray_app import NAME, deployment, uses_gpus

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    check(config)
    ray.init()                      # joins the cluster RAY_ADDRESS names, else starts one on this machine
    gpu = uses_gpus(config)
    if gpu and config.device is None:
        config = dataclasses.replace(config, device="cuda")
    serve.start(http_options={"host": host, "port": port})
    signal.signal(signal.SIGTERM, interrupt)
    try:
        serve.run(deployment(config, replicas, gpu=gpu).bind(), name=NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        serve.delete(NAME)
    finally:
        ray.shutdown()
