"""The plugin registry: the package has no plugins yet, and loading is idempotent per TensorRT module."""

from __future__ import annotations

import types

import pytest

from xcompile.plugins import registry
from xcompile.plugins.registry import PLUGINS, Plugin, PluginError, load_plugins


class Registry:
    """Records what a TensorRT plugin registry is asked."""

    def __init__(self, known=()):
        self.known, self.loaded = set(known), []

    def get_creator(self, name, version, namespace=""):
        return object() if (name, version) in self.known else None

    def load_library(self, path):
        self.loaded.append(path)
        return object()


def fake_trt(reg: Registry, name: str = "tensorrt_rtx"):
    return types.SimpleNamespace(__name__=name, __version__="1.7.1.116", get_plugin_registry=lambda: reg)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", set())


def test_package_has_no_plugins_yet():
    assert PLUGINS == ()
    reg = Registry()
    assert load_plugins(fake_trt(reg)) == [] and reg.loaded == []


def test_loading_is_idempotent_per_tensorrt_module(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "PLUGIN_DIR", tmp_path)
    (tmp_path / "libtoy.so").write_bytes(b"")
    toy = (Plugin("Toy", "1", "libtoy.so"),)
    reg = Registry()
    assert load_plugins(fake_trt(reg), toy) == ["Toy"]
    assert load_plugins(fake_trt(reg), toy) == ["Toy"]
    assert reg.loaded == [str(tmp_path / "libtoy.so")]
    other = Registry()                                   # another flavor's registry loads it too
    load_plugins(fake_trt(other, "tensorrt"), toy)
    assert len(other.loaded) == 1


def test_already_registered_creator_is_not_reloaded(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "PLUGIN_DIR", tmp_path)
    reg = Registry(known={("Toy", "1")})
    assert load_plugins(fake_trt(reg), (Plugin("Toy", "1", "libtoy.so"),)) == ["Toy"]
    assert reg.loaded == []


def test_missing_library_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "PLUGIN_DIR", tmp_path)
    with pytest.raises(PluginError, match="libgone.so: plugin library for Gone v2 missing"):
        load_plugins(fake_trt(Registry()), (Plugin("Gone", "2", "libgone.so"),))


@pytest.mark.trt
def test_real_registry_accepts_the_empty_list():
    import importlib.util

    trt = __import__("tensorrt" if importlib.util.find_spec("tensorrt") else "tensorrt_rtx")
    assert load_plugins(trt) == []
    assert load_plugins(trt) == []
