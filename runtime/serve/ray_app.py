"""The same app as a Ray Serve application: replicas behind Ray's proxy, one per GPU (``num_gpus=1``;
one CPU each on a machine without GPUs), routed and autoscaled by Ray Serve itself.

    xrun serve DIR --ray --replicas 2           # a local Ray (or the cluster RAY_ADDRESS names)
    serve run xcompile.runtime.serve.ray_app:build engine_dir=DIR replicas=4 backend=trt

Each replica opens the engine dir itself (a shared path, or its own copy at the same path), so every
node needs the dir where ``engine_dir`` says. Inside a replica the scheduling is the server's own:
batch 1, a FIFO queue of ``max_queue``, cancel on disconnect (runtime/serve/scheduler.py); Ray sends a
replica at most ``max_queue + 1`` requests at once, queues up to ``max_queue`` more in its proxy and
answers 503 past that (Ray's back-pressure, not ours).
"""

from __future__ import annotations

from dataclasses import replace

from ray import serve

from xcompile.runtime.common.errors import EngineError
from xcompile.runtime.decoding.registry import DrafterSpec
from xcompile.runtime.engines.run_checks import check_kv_cache_dtype
from xcompile.runtime.serve.app import create_app
from xcompile.runtime.serve.worker import ServeConfig

NAME = "xcompile"


def deployment(config: ServeConfig, replicas: int = 1, autoscaling: dict | None = None, gpu: bool = False):
    """The Ray Serve deployment: ``replicas`` fixed replicas, or Ray's ``autoscaling`` config."""

    def build_app():                # called on each replica: its engines are opened there
        return create_app(config, background_load=False)

    return serve.deployment(
        serve.ingress(build_app)(), name=NAME, num_replicas=None if autoscaling else replicas,
        autoscaling_config=autoscaling, max_ongoing_requests=config.max_queue + 1,
        max_queued_requests=max(config.max_queue, 1),
        ray_actor_options={"num_gpus": 1} if gpu else {"num_cpus": 1})


def uses_gpus(config: ServeConfig) -> bool:
    """Whether replicas take a GPU each: --device cuda, or no --device and the cluster has GPUs."""
    import ray

    return config.device == "cuda" or (config.device is None and ray.cluster_resources().get("GPU", 0) >= 1)


def _flag(value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"expected true or false, got {value!r}")
    return value.lower() in ("true", "1")


# `serve run` arguments (all strings) -> ServeConfig fields or replica settings
ARGS = {"engine_dir": str, "backend": str, "device": str, "served_model_name": str, "api_key": str,
        "max_queue": int, "request_timeout": float, "drafter": str, "gamma": int, "tree_topk": int,
        "tree_depth": int, "tree_tokens": int, "warm_up": _flag, "replicas": int, "min_replicas": int,
        "max_replicas": int, "kv_cache_dtype": str}


def parse(args: dict[str, str]) -> tuple[ServeConfig, int, dict | None]:
    """``serve run``'s key=value arguments -> (config, replicas, autoscaling config or None)."""
    if unknown := sorted(set(args) - set(ARGS)):
        raise EngineError(f"serve run: unknown argument(s) {', '.join(unknown)}; expected engine_dir=DIR and any of "
                          f"{', '.join(sorted(set(ARGS) - {'engine_dir'}))}")
    if "engine_dir" not in args:
        raise EngineError("serve run: engine_dir=DIR is required")
    try:
        a = {k: ARGS[k](v) for k, v in args.items()}
    except ValueError as e:
        raise EngineError(f"serve run: {e}") from None
    check_kv_cache_dtype(a.get("kv_cache_dtype", "auto"))
    spec = DrafterSpec.from_options(a.pop("drafter", "auto"), a.pop("gamma", None), a.pop("tree_topk", None),
                                    a.pop("tree_depth", None), a.pop("tree_tokens", None))
    replicas = a.pop("replicas", 1)
    scale = {k: a.pop(k) for k in ("min_replicas", "max_replicas") if k in a}
    autoscaling = None
    if scale:
        # Ray scales on ongoing requests per replica: one on the device is what a batch-1 replica is for
        autoscaling = {"min_replicas": 1, **scale, "target_ongoing_requests": 1}
        autoscaling["max_replicas"] = max(autoscaling.get("max_replicas", 1), autoscaling["min_replicas"])
    return ServeConfig(drafter=spec, **a), replicas, autoscaling


def build(args: dict[str, str]):
    """``serve run``'s application builder (module docstring): ``xrun serve``'s options as key=value
    (``warm_up=false`` for --no-warm-up), ``replicas=N``, or ``min_replicas=A max_replicas=B`` for Ray's
    autoscaling."""
    config, replicas, autoscaling = parse(args)
    gpu = uses_gpus(config)
    return deployment(replace(config, device="cuda") if gpu else config, replicas, autoscaling, gpu).bind()
