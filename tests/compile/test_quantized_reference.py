"""The reference modules of a quantized engine dir keep the checkpoint's codes when asked (compile/reference.py,
``quantized=True``: what the fast backend opens), and those codes are the very weights the modules hold."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from quantize import AWQ_CONFIG, FP8_CONFIG, write_quantized_checkpoint

from xcompile.compile.cli import main
from xcompile.compile.reference import load_torch_models
from xcompile.runtime.enginedir.contract import TARGET
from xcompile.runtime.engines.qweight import FP8, INT4


def test_a_quantized_dirs_reference_keeps_the_codes_of_its_linears(tmp_path):
    for config, kind in (({**AWQ_CONFIG, "group_size": 32}, INT4), (FP8_CONFIG, FP8)):
        ckpt = write_quantized_checkpoint(tmp_path / kind / "ckpt", config)
        out = tmp_path / kind / "engine"
        result = CliRunner().invoke(main, ["export", "--model", str(ckpt), "--out", str(out), "--dtype", "fp32",
                                           "--max-seq-len", "32"])
        assert result.exit_code == 0, result.output
        plain = load_torch_models(out, "cpu")[TARGET].module
        assert plain.quantized == {}                      # not kept unless asked
        module = load_torch_models(out, "cpu", quantized=True)[TARGET].module
        params = dict(module.named_parameters())
        assert len(module.quantized) == 4 * 7 and "lm_head.weight" not in module.quantized
        for name, q in module.quantized.items():
            assert q.kind == kind and torch.equal(q.dequantize(), params[name])
