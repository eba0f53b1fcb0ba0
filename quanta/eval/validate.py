"""`quanta.validate`: perplexity on fixed token windows, and against a reference model the KL divergence,
top-1 agreement and per-layer weight error, with one evaluator for every format so the numbers compare.

    r = quanta.validate("model-Q4_K_M.gguf", reference="model-f16.gguf", n_windows=40)
    print(r.table()); r.to_json()

The reference runs on each window just before the model does and its logits are dropped once the window
is scored, so nothing grows with the text. A reference too large to load beside the model runs alone
first, writing its top-k log-probabilities to a file (`save_reference=`); that file is then passed as
`reference=` (llama.cpp's --kl-divergence-base, then --kl-divergence).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from quanta.engine.llm import LLM
from quanta.eval.layer_error import weight_errors
from quanta.eval.reference_store import ReferenceWriter
from quanta.eval.result import ValidationResult
from quanta.eval.scoring import score_against_logits, score_against_topk, score_alone, top_k_record
from quanta.eval.sides import Side, check_same_vocabulary, open_side
from quanta.eval.stats import Accumulator
from quanta.eval.windows import TokenWindows, WindowSpec, read_text, tokenize
from quanta.loaders import load
from quanta.quant.errors import ConfigError

DEFAULT_TOP_K = 64
TOKENIZER_SAMPLE_CHARS = 20000    # text both tokenizers must agree on


def validate(model: Any, reference: Any = None, *, text: str | Path | None = None, ctx: int = 512,
             n_windows: int | None = None, stride: int | None = None, score: str = "second-half",
             model_options: dict | None = None, reference_options: dict | None = None,
             layer_errors: bool = True, save_reference: str | Path | None = None, top_k: int = DEFAULT_TOP_K,
             progress: bool | None = None) -> ValidationResult:
    """Evaluate `model` (a checkpoint path, synthetic spec or LLM) on `text` (default WikiText-2 raw
    test), in windows of `ctx` tokens as windows.WindowSpec describes, and against `reference` (a path,
    LLM or stored-reference file) when given. `model_options` / `reference_options`: LLM(...) keywords
    for a side given as a path (the reference's default to the model's). `layer_errors`: compare the
    weight matrices where both sides are checkpoints on disk. `save_reference`: also write this model's
    top-`top_k` log-probabilities there, to serve later as a reference. ConfigError for bad input,
    raised before any weights are loaded where the input allows."""
    start = time.perf_counter()
    spec = WindowSpec(ctx=ctx, stride=stride, n_windows=n_windows, score=score)
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {top_k!r}")
    text_path, body = read_text(text)
    ours = open_side(model, model_options, spec.ctx, "model")
    ref = None
    if reference is not None:
        options = reference_options
        if options is None and not isinstance(reference, LLM):
            options = model_options
        ref = open_side(reference, options, spec.ctx, "reference", allow_stored=True)
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
    result = _result(ours, ref, windows, text_path, acc, layer_errors, show)
    result.engine = engine
    result.seconds = time.perf_counter() - start
    return result


def _quiet(side: Side) -> bool:
    config = side.given.config if side.given is not None else side.config
    return bool(config is not None and config.quiet)


def _run(ours: Side, ref: Side | None, windows: TokenWindows, writer: ReferenceWriter | None,
         show: bool) -> tuple[Accumulator, dict]:
    """Score every window: the reference's logits (or stored record) first, then the model's.
    Returns the figures and how the model ran (device, dtype, forced kernel)."""
    first = windows.spec.first_scored
    acc = Accumulator()
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
        if writer is not None:
            writer.add(top_k_record(logits, window, first, writer.header["top_k"]))
        del logits, ref_logits
    engine = {"device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
              "kernel": llm.config.kernel or "auto"}
    return acc, engine


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
