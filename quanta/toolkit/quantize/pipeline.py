"""`quanta.quantize`: any checkpoint quanta reads -> a quantized checkpoint, streamed one layer at a time.

    summary = quanta.quantize("model.gguf", "model-awq", "awq", bits=4, group_size=64)
    summary = quanta.quantize("model/", "model-Q4_K_M.gguf", "gguf", type="Q4_K_M", imatrix=True)
    summary = quanta.quantize("model.gguf", "model-fp8", "gptq", scheme="fp8")     # GPTQ onto FP8 e4m3

Steps, in this order: the options (toolkit/quantize/options.py), the destination, the model (loaded
lazily), the scheme against the model and the format's writer (toolkit/format_check.py), the
calibration tokens; only then the work: quant/quantize_model.py's run (or gguf_stream.GgufStream)
feeding the format's writer tensor by tensor. The writers build the output under a temporary name
beside `out` and rename it at the end, so an error or an interrupt leaves nothing at `out`.
The tokenizer, chat template and generation config (bos / eos) are carried by the writers.
"""
from __future__ import annotations

import time
from pathlib import Path

from quanta.loaders.checkpoint_write import check_destination
from quanta.quant.errors import ConfigError
from quanta.toolkit.quantize.options import QuantizeOptions
from quanta.toolkit.quantize.summary import QuantizeSummary, summarize


def quantize(model: str | Path, out: str | Path, method: str, *, bits: int | None = None,
             group_size: int | None = None, symmetric: bool | None = None, act_order: bool | None = None,
             type: str | None = None, format: str | None = None, calibration: str | Path | None = None,
             n_samples: int | None = None, seqlen: int | None = None, imatrix: bool | str | Path = False,
             save_imatrix: str | Path | None = None, scheme: str | None = None, lm_head: bool = False,
             device: str | None = None, overwrite: bool = False, quiet: bool = False) -> QuantizeSummary:
    """Quantize checkpoint `model` with `method` (rtn, awq, gptq, fp8, nf4, gguf) into `out`.

    bits / group_size / symmetric / act_order: the integer scheme (rtn, awq, gptq; defaults 4, 128,
    asymmetric except gptq, no act-order); group_size is the blocksize for nf4. scheme: the grid gptq
    rounds onto, "int" (default) or "fp8" (e4m3 per channel, dynamic activations, written as --method
    fp8 writes it; act-order unless act_order=False; no bits / group_size / symmetric). type: the GGUF
    type or mix (Q4_0 .. Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS, Q3_K_M, Q4_K_M, Q5_K_M). format: the output
    layout (default per method, see quantize/options.py). calibration: a UTF-8 text file for awq, gptq and
    gguf with `imatrix` (default WikiText-2 test), cut into n_samples windows of seqlen tokens (default
    32 x 512). imatrix: True collects the importance matrix from the calibration text; a path reads
    llama-imatrix's file (GGUF or legacy); save_imatrix: where to write the collected one, as llama-imatrix
    writes it (for llama-quantize, or a later run). lm_head: quantize the lm_head too, in the same integer scheme
    (RTN for awq), written in the gptq format (its config's `lm_head`; GPTQModel and vLLM read it). device: where
    rtn, awq, gptq, fp8 and nf4 run, one layer and the calibration activations at a time ("auto", the default: the
    GPU when there is one; "cpu"; "cuda[:N]"); gguf quantizes on the CPU, in llama.cpp's arithmetic.
    Every ConfigError / UnsupportedError is raised before any weight is quantized.
    """
    start = time.perf_counter()
    opts = QuantizeOptions.resolve(method, bits=bits, group_size=group_size, symmetric=symmetric,
                                   act_order=act_order, type=type, format=format, calibration=calibration,
                                   n_samples=n_samples, seqlen=seqlen, imatrix=imatrix, scheme=scheme,
                                   lm_head=lm_head)
    where = _device(opts, device)
    out = _destination(out, opts, overwrite)
    if save_imatrix is not None:
        if opts.imatrix is not True:
            raise ConfigError("quantize: save_imatrix writes the importance matrix collected from the calibration "
                              "text: it needs --method gguf with imatrix=True (--imatrix alone)")
        save_imatrix = check_destination(save_imatrix, overwrite)
    from quanta.loaders import load
    from quanta.toolkit.quantize.format_check import check_model, writer_options

    ckpt = load(model, **({"tokenizer": False} if _tokenizer_unused(model, opts) else {}))
    check_model(opts, ckpt)
    data = None
    if opts.calibration is not None:
        from quanta.quant.calibration import load_calibration
        if ckpt.tokenizer is None:
            raise ConfigError(f"quantize: {model} has no tokenizer to cut the calibration text with")
        data = load_calibration(ckpt.tokenizer, opts.calibration, opts.n_samples, opts.seqlen)
    if opts.method == "gguf":
        from quanta.loaders.gguf.writer import write_gguf
        from quanta.toolkit.quantize.gguf_stream import GgufStream
        run = GgufStream(ckpt, opts.type, data, quiet, imatrix_file=opts.imatrix
                         if isinstance(opts.imatrix, Path) else None,
                         dataset=opts.calibration.name if opts.calibration is not None else None)
        write_gguf(out, ckpt, run, ggml_type=opts.type, overwrite=overwrite, with_imatrix=bool(opts.imatrix),
                   extra_metadata=run.imatrix_metadata)
        if save_imatrix is not None:
            from quanta.loaders.gguf.imatrix import write_imatrix
            write_imatrix(save_imatrix, {name: (m.sums, m.count) for name, m in run.collected.items()},
                          [opts.calibration.name], opts.n_samples, opts.seqlen)
    else:
        from quanta.loaders import write
        from quanta.quant.quantize_model import quantize_checkpoint
        run = quantize_checkpoint(ckpt, opts.spec(), data, quiet=quiet, device=where)
        write(out, ckpt, opts.format, run, overwrite=overwrite, **writer_options(opts))
    return summarize(out, opts, ckpt, run.report, time.perf_counter() - start)


def _tokenizer_unused(model: str | Path, opts: QuantizeOptions) -> bool:
    """Whether this run never reads the source's tokenizer, so that the load may skip building it (seconds for a
    GGUF vocabulary): GGUF to GGUF without calibration, where the writer copies the vocabulary entries and the chat
    template from the source file's metadata."""
    from quanta.loaders.detection import detect
    return opts.method == "gguf" and opts.calibration is None and detect(model) == "gguf"


def _device(opts: QuantizeOptions, device: str | None):
    """The device the run quantizes on, checked before any work (None for gguf, which runs on the CPU)."""
    if opts.method == "gguf":
        if device not in (None, "auto", "cpu"):
            raise ConfigError(f"quantize --method gguf runs on the CPU (llama.cpp's arithmetic, byte for byte); "
                              f"--device {device} applies to rtn, awq, gptq, fp8 and nf4")
        return None
    from quanta.quant.quantize_model import quantize_device
    return quantize_device(device)


def _destination(out: str | Path, opts: QuantizeOptions, overwrite: bool) -> Path:
    """`out` checked: absent (or `overwrite`), its folder existing, a file for GGUF and a directory otherwise."""
    out = check_destination(out, overwrite)
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent}: the destination folder does not exist")
    if out.exists() and out.is_dir() != (opts.format != "gguf"):
        raise ConfigError(f"{out}: exists as a {'directory' if out.is_dir() else 'file'}; the {opts.format} output "
                          f"is a {'file' if opts.format == 'gguf' else 'directory'}: choose another path")
    return out


__all__ = ["quantize", "QuantizeSummary"]
