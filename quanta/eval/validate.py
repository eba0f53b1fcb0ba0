"""`quanta.validate`: perplexity on fixed token windows, and against a reference model the KL divergence,
top-1 agreement and per-layer weight error, with one evaluator for every format so the numbers compare.

    r = quanta.validate("model-Q4_K_M.gguf", reference="model-f16.gguf", n_windows=40)
    print(r.table()); r.to_json()

Built here from paths, the reference runs first and alone, its float32 logits at every window's scored positions
kept in a scratch file (TMPDIR; windows x ctx/2 x vocab x 4 bytes), then the model: one model in memory at a time,
whatever the number of windows. Given as LLMs, both run window by window. A reference can also be stored once as
top-k log-probabilities (`save_reference=`) and passed as `reference=` later (llama.cpp's --kl-divergence-base).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from quanta.engine import host_heap
from quanta.engine.llm import LLM
from quanta.eval.layer_error import weight_errors
from quanta.eval.reference_store import ReferenceWriter, is_reference_file
from quanta.eval.result import ValidationResult
from quanta.eval.scoring import (
    score_against_logits,
    score_against_rows,
    score_against_topk,
    score_alone,
    scored,
    top_k_record,
)
from quanta.eval.sides import Side, check_same_vocabulary, open_side
from quanta.eval.stats import Accumulator
from quanta.eval.windows import TokenWindows, WindowSpec, read_text, tokenize
from quanta.loaders import load
from quanta.quant.errors import ConfigError

DEFAULT_TOP_K = 64
TOKENIZER_SAMPLE_CHARS = 20000    # text both tokenizers must agree on
# The float32 reference path: every quantized weight dequantized exactly (as the gguf package, AutoAWQ... decode
# it) and float32 activations, so that two checkpoints holding the same values compute the same logits; the
# integer kernels round their inputs (bf16 into torch's int4 kernel), which a lossless conversion must not be
# blamed for.
EXACT_OPTIONS = {"kernel": "dequantized", "dtype": "float32"}


def exact_options(side: Any, options: dict | None, role: str) -> dict:
    """`options` with EXACT_OPTIONS set; ConfigError where the side is a built LLM or the options ask otherwise."""
    if isinstance(side, LLM):
        raise ConfigError(f"exact validation builds the {role} itself on the float32 path; give a checkpoint path, "
                          "not a built LLM")
    merged = dict(options or {})
    for key, value in EXACT_OPTIONS.items():
        if merged.get(key) not in (None, "auto", value):
            raise ConfigError(f"exact validation runs the {role} with {key}={value!r}, not {merged[key]!r}")
        merged[key] = value
    return merged


def validate(model: Any, reference: Any = None, *, text: str | Path | None = None, ctx: int = 512,
             n_windows: int | None = None, stride: int | None = None, score: str = "second-half",
             model_options: dict | None = None, reference_options: dict | None = None,
             layer_errors: bool = True, save_reference: str | Path | None = None, top_k: int = DEFAULT_TOP_K,
             progress: bool | None = None, exact: bool = False) -> ValidationResult:
    """Evaluate `model` (a checkpoint path, synthetic spec or LLM) on `text` (default WikiText-2 raw
    test), in windows of `ctx` tokens as windows.WindowSpec describes, and against `reference` (a path,
    LLM or stored-reference file) when given. `model_options` / `reference_options`: LLM(...) keywords
    for a side given as a path (the reference's default to the model's). `layer_errors`: compare the
    weight matrices where both sides are checkpoints on disk. `save_reference`: also write this model's
    top-`top_k` log-probabilities there, to serve later as a reference. `exact`: both sides on the float32
    reference path (EXACT_OPTIONS), where a lossless conversion gives the reference's logits bit for bit.
    ConfigError for bad input, raised before any weights are loaded where the input allows."""
    start = time.perf_counter()
    if reference_options is None and not isinstance(reference, LLM):
        reference_options = model_options          # a reference given as a path runs as the model does
    if exact:
        model_options = exact_options(model, model_options, "model")
        if reference is not None and not (isinstance(reference, (str, Path)) and is_reference_file(reference)):
            reference_options = exact_options(reference, reference_options, "reference")
    spec = WindowSpec(ctx=ctx, stride=stride, n_windows=n_windows, score=score)
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    text_path, body = read_text(text)
    ours = open_side(model, model_options, spec.ctx, "model")
    ref = None
    if reference is not None:
        ref = open_side(reference, reference_options, spec.ctx, "reference", allow_stored=True)
        check_same_vocabulary(ours, ref, body[:TOKENIZER_SAMPLE_CHARS])
    windows = tokenize(ours.tokenizer, body, spec)
    if ref is not None and ref.stored is not None:
        ref.stored.check(windows)
    writer = None if save_reference is None else ReferenceWriter(
        save_reference, windows, model=ours.name, top_k=top_k, vocab_size=ours.vocab_size, text=str(text_path))
    show = progress if progress is not None else not _quiet(ours)
    try:
        acc, engine = _run(ours, ref, windows, writer, show)
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        ours.close()
        if ref is not None:
            ref.close()
        host_heap.trim()
    result = _result(ours, ref, windows, text_path, acc, layer_errors, show)
    result.engine = engine
    result.seconds = time.perf_counter() - start
    return result


def _quiet(side: Side) -> bool:
    config = side.given.config if side.given is not None else side.config
    return bool(config is not None and config.quiet)


def _run(ours: Side, ref: Side | None, windows: TokenWindows, writer: ReferenceWriter | None,
         show: bool) -> tuple[Accumulator, dict]:
    """Score every window against the reference (its logits, or its stored record) and return the figures and how
    the model ran (device, dtype, forced kernel). Where validate builds both models itself, one at a time
    (_reference_rows_on_disk); given LLMs, both already held, go window by window."""
    first = windows.spec.first_scored
    acc = Accumulator()
    if ref is not None and ref.stored is None and ref.given is None and ours.given is None:
        with tempfile.TemporaryDirectory(prefix="quanta-validate-") as scratch:
            rows = _reference_rows_on_disk(ref, windows, Path(scratch), show)
            llm = ours.llm()
            for i, window in enumerate(tqdm(windows.windows, desc="windows", disable=not show)):
                logits = llm.prompt_logits(window)
                acc.add(score_against_rows(logits, rows(i), window, first))
                _write_record(writer, logits, window, first)
                del logits
                host_heap.trim()
            del rows
        return acc, _engine(llm)
    ref_llm = ref.llm() if ref is not None and ref.stored is None else None
    llm = ours.llm()
    for i, window in enumerate(tqdm(windows.windows, desc="windows", disable=not show)):
        ref_logits = ref_llm.prompt_logits(window) if ref_llm is not None else None
        logits = llm.prompt_logits(window)
        if ref_logits is not None:
            acc.add(score_against_logits(logits, ref_logits, window, first))
        elif ref is not None:
            acc.add(score_against_topk(logits, ref.stored.record(i), window, first))
        else:
            acc.add(score_alone(logits, window, first))
        _write_record(writer, logits, window, first)
        del logits, ref_logits
    return acc, _engine(llm)


def _reference_rows_on_disk(ref: Side, windows: TokenWindows, scratch: Path,
                            show: bool) -> Callable[[int], torch.Tensor]:
    """The reference's float32 logits at every window's scored positions, computed with the reference alone and
    written to a file under `scratch` (windows x scored x vocab x 4 bytes); returns a reader of window i's rows.
    The reference is closed and its heap returned before the model loads, so the two never share the host's
    memory; the file is read, not mapped, so its pages stay out of the process. Float32 as computed: a lossless
    conversion then scores KL 0 exactly."""
    llm = ref.llm()
    first, ctx = windows.spec.first_scored, windows.spec.ctx
    shape = (ctx - first, llm.core.checkpoint.config.vocab_size)
    path = scratch / "reference-logits.f32"
    with open(path, "wb") as f:
        for window in tqdm(windows.windows, desc="reference", disable=not show):
            logits = llm.prompt_logits(window)
            f.write(scored(logits, window, first)[0].float().contiguous().cpu().numpy().tobytes())
            del logits
            host_heap.trim()
    ref.close()
    host_heap.trim()
    count = shape[0] * shape[1]

    def rows(i: int) -> torch.Tensor:
        with open(path, "rb") as f:
            f.seek(i * count * 4)
            return torch.from_numpy(np.fromfile(f, dtype=np.float32, count=count).reshape(shape))
    return rows


def _write_record(writer: ReferenceWriter | None, logits: torch.Tensor, window: list[int], first: int) -> None:
    if writer is not None:
        writer.add(top_k_record(logits, window, first, writer.header["top_k"]))


def _engine(llm: LLM) -> dict:
    """How the model ran: device, dtype, forced kernel."""
    return {"device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
            "kernel": llm.config.kernel or "auto"}


def _result(ours: Side, ref: Side | None, windows: TokenWindows, text_path: Path, acc: Accumulator,
            layer_errors: bool, show: bool) -> ValidationResult:
    spec = windows.spec
    ppl, ppl_err = acc.perplexity()
    result = ValidationResult(model=ours.name, text=str(text_path), ctx=spec.ctx, stride=spec.stride,
                              score=spec.score, windows=len(windows.windows), scored_tokens=acc.count,
                              bos_token_id=windows.bos_token_id, perplexity=ppl, perplexity_stderr=ppl_err)
    if ref is not None:
        result.reference = ref.name
        result.reference_perplexity, result.reference_perplexity_stderr = acc.perplexity(reference=True)
        result.kl = acc.kl_stats(None if ref.stored is None else ref.stored.top_k)
        if layer_errors and ours.path is not None and ref.path is not None:
            result.layers, result.unmatched_tensors = weight_errors(load(ours.path), load(ref.path), progress=show)
    return result
