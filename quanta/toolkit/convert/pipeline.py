"""`quanta.convert`: one checkpoint format to another, exact where the target can hold the source, re-quantized
otherwise, with a per-tensor report and (by default) a validation of the output against the source.

    report = quanta.convert("model.gguf", "hf", "model-hf/")                # dequantized, loads in transformers
    report = quanta.convert("llama-awq/", "gptq", "llama-gptq/")            # lossless (GPTQ v2)
    report = quanta.convert("llama-hf/", "gguf:Q4_K_M", "llama.Q4_K_M.gguf")
    print(report.summary())
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from quanta.loaders import load
from quanta.loaders.formats import convert_targets
from quanta.loaders.checkpoint import Checkpoint
from quanta.quant.errors import ConfigError
from quanta.toolkit.convert.output import Staging, check_paths
from quanta.toolkit.convert.report import ConvertReport, TensorRecord
from quanta.toolkit.convert.defaults import DEFAULT_CTX, DEFAULT_GROUP, DEFAULT_SHARD_SIZE, DEFAULT_WINDOWS
from quanta.toolkit.convert.rules import TensorConverter
from quanta.toolkit.convert.target import Target, parse_target

log = logging.getLogger(__name__)



def convert(src: str | Path, to: str, out: str | Path, *, force: bool = False, validate: bool = True,
            dtype: str | None = None, calibration: str | Path | None = None, group_size: int = DEFAULT_GROUP,
            windows: int = DEFAULT_WINDOWS, ctx: int = DEFAULT_CTX, text: str | Path | None = None,
            validate_options: dict[str, Any] | None = None, max_shard_size: int | str = DEFAULT_SHARD_SIZE,
            quiet: bool = False, merge_lora: str | Path | None = None) -> ConvertReport:
    """Convert checkpoint `src` to format `to` (convert/target.py: hf, awq, gptq, compressed-tensors, fp8, nf4,
    gguf[:TYPE]) at `out` (a directory; a file for gguf) and return the ConvertReport, also stored beside the
    output (DST/quanta_convert.json, or DST.convert.json next to a GGUF file).

    The conversion streams tensor by tensor: peak host memory is at most twice the largest tensor in float32
    (a quantized tensor re-quantized is dequantized once, beside its source and output forms; quantizers,
    bit packing, casts and error sums go a block of rows at a time, quant.chunks), plus one output shard
    (`max_shard_size`; GGUF output spills each tensor to disk instead) and a few MB of fixed scratch, never
    the whole model.
    Memory-mapped source pages are not counted: the kernel reclaims them. With `calibration` (AWQ / GPTQ)
    one decoder layer and the calibration activations are held instead.

    `out` appears complete or not at all: everything is written in `.<out name>.tmp-*` beside it and renamed
    at the end; on any exception nothing is left at `out` and the source is never written. An existing
    `out` is refused unless `force`; converting onto the source is refused. With `validate` the output is
    evaluated against the source on `windows` windows of `ctx` tokens of `text` (quanta.validate; engine
    options `validate_options`) and the figures go into the report and DST/quanta_validation.json
    (DST.validation.json for GGUF). `dtype`: the float dtype of the output's unquantized tensors (hf: of
    every tensor). `group_size`: of re-quantized AWQ/GPTQ/compressed-tensors weights when the source does
    not fix one. ConfigError / UnsupportedError naming the problem, before any output is written where the
    input allows.

    `merge_lora`: a peft adapter directory or GGUF LoRA file whose product is added to each weight it targets,
    W + scaling * B @ A in float32 (a quantized W dequantized first; the sum then stored as the target stores
    a float weight, re-quantized where the target is quantized), adding the merged weight's float32 copy to
    the memory bound. Such weights are reported "merged", never lossless, with the error of storing the merged
    weight. The validation (never on the exact path) compares the adapted output with the unmerged source, so
    its figures include the adapter's own change: no merged float reference exists to separate the two.
    
    Lossless pairs: AWQ <-> GPTQ v2 without act-order, symmetric GPTQ -> AWQ, GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 <->
    affine integer formats where the integer form exists (Q4_0/Q5_0/Q8_0 have integer zero points; Q4_1/Q5_1
    float mins, which AWQ/GPTQ cannot store), anything -> hf float32 (fp16/bf16 where the dequantized values fit).
    Everything else is re-quantized per tensor (convert/rules.py) or, for AWQ/GPTQ with `calibration`, by the
    calibrated algorithm (quant.quantize_model). Tokenizer, chat template, bos/eos and config travel with the
    weights in both directions (safetensors <-> GGUF metadata).
    """
    start = time.perf_counter()
    target = parse_target(to, dtype)
    src, out = Path(src), Path(out)
    if not src.exists():
        raise ConfigError(f"{src}: no such checkpoint")
    check_paths(src, out, force)
    if calibration is not None and target.calibrated is None:
        calibrated = [name for name, (_, t) in convert_targets().items() if t.calibrated]
        raise ConfigError(f"--calibration applies to {' and '.join(calibrated)} outputs, not {target}")
    if not isinstance(windows, int) or windows < 1 or not isinstance(ctx, int) or ctx < 2:
        raise ConfigError(f"validation needs windows >= 1 and ctx >= 2, got {windows!r} and {ctx!r}")
    ckpt = load(src)
    report = ConvertReport(source=str(src), source_format=ckpt.format, output=str(out), target=str(target))
    merged = None
    if merge_lora is not None:
        from quanta.toolkit.convert.merge import lora_summary, merge_lora as merge
        ckpt, merged = merge(ckpt, merge_lora)
        report.merged_lora = lora_summary(merged)
    converter = TensorConverter(ckpt, target, group_size)
    stream = _stream(ckpt, target, converter, calibration, group_size, quiet, report.tensors)
    with Staging(out, target.is_file, force) as stage:
        _write(stage.main, ckpt, target, converter, stream, max_shard_size)
        if merged is not None:
            from quanta.toolkit.convert.merge import mark_merged
            mark_merged(report.tensors, merged)
        if validate:
            result = _validate(stage.main, src, windows, ctx, text, validate_options, quiet, report.lossless)
            stage.sidecar("validation").write_text(result.to_json() + "\n", encoding="utf-8")
            report.validation = validation_summary(result)
            if merged is not None:
                report.validation["reference"] = "the unmerged source"
        report.seconds = time.perf_counter() - start
        stage.sidecar("convert").write_text(report.to_json(), encoding="utf-8")
    return report


def _write(dst: Path, ckpt: Checkpoint, target: Target, converter: TensorConverter, stream: Iterable,
           max_shard_size: int | str) -> None:
    from quanta.loaders import write
    if target.is_file:
        options: dict[str, Any] = {"ggml_type": target.ggml_type, "name": ckpt.path.stem}
    else:
        options = {"max_shard_size": max_shard_size, **converter.writer_options}
    write(dst, ckpt, target.format.name, stream, **options)


def _stream(ckpt: Checkpoint, target: Target, converter: TensorConverter, calibration: str | Path | None,
            group_size: int, quiet: bool, records: list[TensorRecord]) -> Iterator:
    """The converted (name, tensor) pairs in checkpoint order, appending one record each."""
    if calibration is not None and not _all_linears_exact(ckpt, converter):
        yield from _calibrated(ckpt, target, calibration, group_size, quiet, records)
        return
    from tqdm import tqdm
    for name in tqdm(list(ckpt.tensors), desc=f"convert -> {target}", disable=quiet):
        t, record = converter(name, ckpt.tensors[name])
        records.append(record)
        yield name, t


def _all_linears_exact(ckpt: Checkpoint, converter: TensorConverter) -> bool:
    """Whether every decoder linear converts exactly (then calibration has nothing to do); reads each once."""
    from quanta.quant.qtensor import QTensor
    from quanta.toolkit.convert.rules import is_linear
    probe = TensorConverter(ckpt, converter.target, converter.default_group)
    for name in ckpt.tensors:
        if is_linear(name):
            t = ckpt.tensors[name]
            if not (isinstance(t, QTensor) and probe._exact(name, t)):
                return False
    return True


def _calibrated(ckpt: Checkpoint, target: Target, calibration: str | Path, group_size: int, quiet: bool,
                records: list[TensorRecord]) -> Iterator:
    """Every linear re-quantized by AWQ / GPTQ on `calibration` text (quantize_checkpoint), layer by layer."""
    from quanta.quant.calibration import load_calibration
    from quanta.quant.quantize_model import QuantSpec, quantize_checkpoint
    from quanta.toolkit.convert.report import scheme_of
    from quanta.toolkit.convert.rules import is_linear
    if ckpt.tokenizer is None:
        raise ConfigError(f"{ckpt.path}: calibration needs the checkpoint's tokenizer, and it has none")
    data = load_calibration(ckpt.tokenizer, calibration, n_samples=32, seqlen=256)
    spec = QuantSpec(target.calibrated, bits=4, group_size=group_size)
    run = quantize_checkpoint(ckpt, spec, data, quiet=quiet)
    sources = {name: scheme_of(ckpt.tensors[name]) for name in ckpt.tensors}
    for name, t in run:
        row = next((r for r in reversed(run.report) if r.name == name), None)
        if is_linear(name) and row is not None:
            action = "requantized" if "dense" not in sources[name] else "quantized"
            records.append(TensorRecord(name, sources[name], scheme_of(t), action, False, row.weight_error,
                                        f"{target.calibrated} calibrated"))
        else:
            same = sources[name] == scheme_of(t)
            records.append(TensorRecord(name, sources[name], scheme_of(t), "copied" if same else "dequantized",
                                        same, 0.0 if same else None))
        yield name, t


def _validate(output: Path, src: Path, windows: int, ctx: int, text, options: dict | None, quiet: bool,
              lossless: bool):
    """The output against its source. A lossless conversion is checked on the float32 reference path (validate's
    `exact`), where it must give the source's logits exactly, unless `options` name a kernel or dtype."""
    from quanta.eval import validate
    opts = dict(options or {})
    if quiet:
        opts.setdefault("quiet", True)
    exact = lossless and not {"kernel", "dtype"} & {k for k, v in opts.items() if v not in (None, "auto")}
    return validate(str(output), reference=str(src), text=text, ctx=ctx, n_windows=windows,
                    model_options=opts, layer_errors=False, progress=not quiet, exact=exact)


def validation_summary(result) -> dict[str, Any]:
    """The figures of a ValidationResult that the report keeps."""
    kl = result.kl
    return {"windows": result.windows, "ctx": result.ctx, "scored_tokens": result.scored_tokens,
            "engine": result.engine, "perplexity": result.perplexity, "reference_perplexity": result.reference_perplexity,
            "kl_mean": None if kl is None else kl.mean, "top1_agreement": None if kl is None else kl.top1_agreement}


def validation_line(v: dict[str, Any]) -> str:
    """One line: perplexity change, KL divergence, top-1 agreement."""
    ref, ppl = v["reference_perplexity"], v["perplexity"]
    change = f" ({(ppl / ref - 1) * 100:+.2f}%)" if ref else ""
    against = f"; against {v['reference']}" if v.get("reference") else ""
    return (f"validate: perplexity {ref:.4g} -> {ppl:.4g}{change}, KL {v['kl_mean']:.4g} nats, "
            f"top-1 {v['top1_agreement'] * 100:.1f}% ({v['windows']} x {v['ctx']} tokens{against})")
