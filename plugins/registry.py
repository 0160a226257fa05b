"""The package's TensorRT plugins and their registration in TensorRT's plugin registry.

Standard opset-24 ops (TensorScatter, Attention, RotaryEmbedding, RMSNormalization) cover Qwen3 and
EAGLE3, so ``PLUGINS`` is empty; a plugin joins it with a torch reference, an ONNX custom-op export
and a test (docs/design.md). Builder and runtime call ``load_plugins(trt)`` before parsing or
deserializing, with whichever TensorRT module (tensorrt or tensorrt_rtx) they use; plugins import
nothing from runtime or compile, so the module is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PLUGIN_DIR = Path(__file__).parent


@dataclass(frozen=True)
class Plugin:
    """One plugin: the creator it registers and the shared library (inside this package) that holds it."""

    name: str
    version: str
    library: str                    # file name relative to PLUGIN_DIR
    namespace: str = ""


PLUGINS: tuple[Plugin, ...] = ()

# (TensorRT module name, plugin) pairs already registered in this process: loading is idempotent
_loaded: set[tuple[str, Plugin]] = set()


class PluginError(Exception):
    """A plugin library is missing or TensorRT refused it."""


def load_plugins(trt, plugins: tuple[Plugin, ...] | None = None) -> list[str]:
    """Register every plugin of the package with ``trt``'s plugin registry, once per process.

    Returns the names of the plugins available afterwards (all of them; empty while none exist).
    """
    plugins = PLUGINS if plugins is None else plugins
    registry = trt.get_plugin_registry()
    for plugin in plugins:
        key = (trt.__name__, plugin)
        if key in _loaded or registry.get_creator(plugin.name, plugin.version, plugin.namespace) is not None:
            _loaded.add(key)
            continue
        path = PLUGIN_DIR / plugin.library
        if not path.is_file():
            raise PluginError(f"{path}: plugin library for {plugin.name} v{plugin.version} missing; reinstall xcompile")
        if registry.load_library(str(path)) is None:
            raise PluginError(f"{path}: TensorRT {trt.__version__} could not load the {plugin.name} plugin library")
        _loaded.add(key)
    return [p.name for p in plugins]
