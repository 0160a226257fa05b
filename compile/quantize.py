"""``xcompile quantize``: a bf16 / fp32 Qwen3 checkpoint in, a quantized checkpoint dir out, through
llm-compressor (``pip install -e '.[quantize]'``), which writes compressed-tensors: the format xcompile's
loader already reads (compile/quantization.py, compile/checkpoint/quantized.py).

    fp8        FP8 e4m3 weights, one fp32 scale per [128, 128] block (compressed-tensors' FP8_BLOCK preset,
               as Qwen/Qwen3-8B-FP8 is blocked). The preset's dynamic per-group fp8 activations are recorded in
               the config; xcompile computes activations in the model's dtype (W8A16)
    int4-awq   int4 weights with a zero point and an fp32 scale per group of 128 inputs (W4A16_ASYM), the
               channel scales chosen by AWQ on the calibration text first

Both round with GPTQ on the calibration text: each column's rounding error is carried into the columns not yet
rounded, through the inverse Hessian of the layer's inputs, where nearest rounding drops it. On the demo target
it moved top-1 agreement with bf16 from 98.43 to 99.26 % (fp8) and from 94.22 to 97.29 % (int4-awq)
(docs/performance.md), past issue 36's 99 and 96 %.

The output holds config.json with its quantization_config, model.safetensors, llm-compressor's recipe.yaml
and the source's tokenizer and generation config; it is staged (runtime/common/files.py) and read back
(its quantization_config parsed as the loader parses it) before it is renamed into place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from xcompile.compile import data as textdata
from xcompile.compile.checkpoint import resolve
from xcompile.compile.config import Qwen3Config
from xcompile.compile.errors import CompileError, CompileOptionError
from xcompile.compile.hf_config import parse_qwen3, read_json
from xcompile.compile.pipeline import TOKENIZER_FILES
from xcompile.compile.quantization import CT_FLOAT, CT_PACKED, parse_quantization
from xcompile.runtime.common import files, logs
from xcompile.runtime.enginedir.text import Text

# the demo's held-out text (data/README.md), what train-eagle3's and the demo's checks read; in a source checkout
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[1] / "data" / "corpus.heldout.txt"
# both presets' block / group width (FP8_BLOCK's block_structure, W4A16_ASYM's group_size): each linear's input
# width must be a multiple of it, and every Qwen3 from 0.6B to 32B has such widths
GROUP = 128


@dataclass(frozen=True)
class Scheme:
    preset: str                 # compressed-tensors' preset scheme name
    layout: str                 # what the loader reads it as (compile/quantization.py)
    awq: bool                   # AWQ's calibrated channel scales before GPTQ's rounding
    summary: str


SCHEMES = {
    "fp8": Scheme("FP8_BLOCK", CT_FLOAT, False, f"fp8 e4m3 weights, fp32 scales per [{GROUP}, {GROUP}] block"),
    "int4-awq": Scheme("W4A16_ASYM", CT_PACKED, True, f"int4 weights with zero points, fp32 scales per {GROUP} "
                       "inputs, AWQ-calibrated"),
}


@dataclass(frozen=True)
class QuantizeOptions:
    scheme: str
    calibration: Path | None = None     # text (plain or JSONL, as train-eagle3 reads); None: the default
    samples: int = 64                   # calibration windows, spread over the text
    seq_len: int = 512                  # tokens per window


@dataclass(frozen=True)
class QuantizeResult:
    out: Path
    scheme: str
    quantized: int                      # linear layers stored quantized
    unquantized: list[str]              # linear layers left in the float dtype (lm_head)
    windows: int                        # calibration windows
    tokens: int
    seconds: float

    def line(self) -> str:
        calib = f", calibrated on {self.windows} windows ({self.tokens} tokens)" if self.windows else ""
        return (f"{self.out}: {self.scheme} ({SCHEMES[self.scheme].summary}), {self.quantized} linear layers "
                f"quantized, {', '.join(self.unquantized) or 'none'} kept{calib}, {self.seconds:.1f} s")


def quantize_checkpoint(model: str | Path, out: str | Path, opts: QuantizeOptions, *, force: bool = False,
                        revision: str | None = None, log: Callable[[str], None] = print) -> QuantizeResult:
    """Quantize the Qwen3 checkpoint ``model`` (a dir, cached repo id or alias) into the dir ``out``.
    Every input is checked before the model loads; ``out`` is replaced only with ``force``, and only a dir
    xcompile wrote (or an empty one)."""
    start = time.monotonic()
    scheme = SCHEMES[opts.scheme]
    source = resolve(str(model), revision)
    cfg = _check_source(source)
    if opts.seq_len > cfg.context_length:
        raise CompileOptionError(f"--seq-len {opts.seq_len} is longer than the {cfg.context_length} positions "
                           f"of {source / 'config.json'}; pass at most that")
    calibration = Path(opts.calibration) if opts.calibration is not None else DEFAULT_CALIBRATION
    if opts.calibration is None and not calibration.is_file():
        raise CompileError(f"{calibration}: the default calibration text is not here (it ships with a source "
                           "checkout of xcompile); pass --calibration FILE")
    windows = calibration_windows(calibration, Text(source), opts.samples, opts.seq_len)
    with files.staged_dir(out, "xcompile quantize", inputs=(source, calibration), replace=force) as tmp:
        quantized, unquantized = _quantize_into(tmp, source, scheme, windows, log)
    return QuantizeResult(Path(out), opts.scheme, quantized, unquantized, windows.shape[0], windows.numel(),
                          time.monotonic() - start)


def _check_source(source: Path) -> Qwen3Config:
    """The config of a dense Qwen3 whose linear widths the blocks tile."""
    config = source / "config.json"
    data = read_json(config)
    if "quantization_config" in data:
        q = data["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CompileError(f"{config}: the checkpoint is quantized already (quant_method {method!r}); quantize the "
                           "bf16 or fp32 checkpoint it came from")
    cfg = parse_qwen3(config, data)
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_attention_heads * head_dim": cfg.num_attention_heads * cfg.head_dim}
    for name, width in widths.items():
        if width % GROUP:
            raise CompileError(f"{config}: {name} is {width}, not a multiple of {GROUP}: the quantized blocks of "
                               f"{GROUP} inputs must tile every linear layer's input")
    return cfg


def calibration_windows(path: Path, text: Text, samples: int, seq_len: int) -> torch.Tensor:
    """Up to ``samples`` windows [n, seq_len] of ``path``'s tokens (documents joined by the document-end token),
    evenly spread over the text; one shorter window when the text holds fewer than ``seq_len`` tokens."""
    seqs, doc_end = textdata.tokenize(textdata.read_records(path), text), textdata.doc_end_id(text)
    if not any(seqs):
        raise CompileError(f"{path}: holds no text to calibrate on; pass --calibration a file of text like the "
                           "model's inputs (plain text, or JSONL with 'text' or 'prompt')")
    stream = [t for s in seqs for t in (*s, doc_end)]
    if len(stream) < seq_len:
        return torch.tensor([stream])
    windows = textdata.pack(seqs, doc_end, seq_len)
    if windows.shape[0] > samples:
        windows = windows[torch.linspace(0, windows.shape[0] - 1, samples).round().long()]
    return windows


def _quantize_into(out: Path, source: Path, scheme: Scheme, windows: torch.Tensor,
                   log: Callable[[str], None]) -> tuple[int, list[str]]:
    """Load ``source`` with transformers, quantize it with llm-compressor, write it into ``out`` and read the
    written quantization_config back as the loader will. Returns the quantized and the kept linear layers."""
    # llm-compressor logs to stdout, which holds xcompile's results only: its messages go to stderr instead (those
    # of its import through stdout redirected; later ones through a sink of its logger), its errors always, the
    # rest (its lifecycle, "no accelerator" as it is imported) with -v
    level = logs.logger("compile").getEffectiveLevel()
    verbose = level <= logging.DEBUG
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stdout(sys.stderr if verbose else null):
            from llmcompressor import LoggerConfig, configure_logger
    except ImportError as e:
        raise CompileError(f"xcompile quantize needs llm-compressor ({e}); install it with pip install -e "
                           "'.[quantize]'") from None
    from loguru import logger as library_log

    configure_logger(LoggerConfig(console_log_level=None))
    library_log.add(sys.stderr, level="DEBUG" if verbose else "ERROR", format="llmcompressor {level}: {message}")
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform import AWQModifier
    from transformers import AutoModelForCausalLM

    log(f"loading {source}")
    with _library_output(quiet=level > logging.INFO):
        try:
            model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")     # the checkpoint's own dtype
        except (OSError, ValueError, SafetensorError) as e:
            raise CompileError(f"{source}: transformers cannot load the checkpoint ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); check its files") from None
        recipe = [GPTQModifier(targets="Linear", scheme=scheme.preset, ignore=["lm_head"])]
        if scheme.awq:
            # AWQ grid-searches each layer's input-channel scales on the calibration activations (duo scaling:
            # from activations alone and from activations and weights), before GPTQ rounds
            recipe.insert(0, AWQModifier(duo_scaling="both"))
        log(f"{'AWQ and ' if scheme.awq else ''}GPTQ on {windows.shape[0]} windows of {windows.shape[1]} tokens")
        with _no_pinning_without_accelerator():
            oneshot(model=model, recipe=recipe, dataset=Dataset.from_dict({"input_ids": windows.tolist()}),
                    num_calibration_samples=windows.shape[0], max_seq_length=windows.shape[1],
                    shuffle_calibration_samples=False)
        model.save_pretrained(out, save_compressed=True)
        umask = os.umask(0)
        os.umask(umask)
        for written in out.iterdir():                   # the library writes its weights 0600, like a temp file
            written.chmod(0o666 & ~umask)
        for name in TOKENIZER_FILES:                    # the source's own files, as it ships them
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
        q = parse_quantization(out / "config.json", read_json(out / "config.json"))
        layouts = {s.layout for _, s, _ in q.groups} if q is not None else set()
        if layouts != {scheme.layout}:
            raise CompileError(f"{out / 'config.json'}: llm-compressor wrote layouts {sorted(layouts)}, expected "
                               f"{scheme.layout!r}; this llm-compressor version writes what xcompile does not read")
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        kept = [n for n in linears if q.scheme_for(n) is None]
        return len(linears) - len(kept), kept


@contextlib.contextmanager
def _library_output(quiet: bool):
    """-q / -qq: what transformers and llm-compressor print themselves (progress bars, warnings) is dropped too,
    and transformers' log kept to errors; xcompile's own lines stay."""
    if not quiet:
        yield
        return
    from transformers.utils import logging as hf_logging

    torch_log = logging.getLogger("torch")          # its own stderr handler (torch.fx's tracing notes)
    level, torch_level = hf_logging.get_verbosity(), torch_log.level
    hf_logging.set_verbosity_error()
    torch_log.setLevel(logging.ERROR)
    try:
        with logs.others_silenced():
            yield
    finally:
        hf_logging.set_verbosity(level)
        torch_log.setLevel(torch_level)


@contextlib.contextmanager
def _no_pinning_without_accelerator():
    """llm-compressor 0.14's sequential pipeline (AWQ's and GPTQ's) pins its cached activations in page-locked memory before each layer's grid
    search, to copy them to an accelerator faster, without checking that there is one; torch refuses to pin
    without one ("Cannot access accelerator device when none is available"). Its own calibration data loader
    pins only when ``torch.accelerator.is_available()``: the same rule here, so AWQ runs on a CPU-only machine
    with the same numbers (pinning moves no value)."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    pin = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = pin
