"""The two sides of a validation, opened before anything heavy runs: a model given as a path (opened for
its config and tokenizer only, built later), an LLM already built, or, for the reference only, a file
of stored log-probabilities. Every check that can fail on the user's input runs here, before weights
are read."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quanta.engine.config import EngineConfig
from quanta.engine.core import EngineCore
from quanta.engine.llm import LLM
from quanta.engine.model_loader import open_checkpoint
from quanta.loaders.synthetic import is_synthetic
from quanta.eval.reference_store import ReferenceLogprobs, is_reference_file
from quanta.loaders.checkpoint import Checkpoint
from quanta.quant.errors import ConfigError


@dataclass(eq=False)
class Side:
    """One model of the comparison. `llm` is built on first use unless given; `stored` is set for a
    reference given as a stored log-probability file (then there is no model)."""
    name: str
    path: Path | None = None                  # a checkpoint on disk (for the weight error), if any
    config: EngineConfig | None = None
    checkpoint: Checkpoint | None = None
    given: LLM | None = None
    stored: ReferenceLogprobs | None = None
    _built: LLM | None = None

    @property
    def vocab_size(self) -> int:
        if self.stored is not None:
            return self.stored.vocab_size
        return (self.given.checkpoint if self.given is not None else self.checkpoint).config.vocab_size

    @property
    def tokenizer(self):
        if self.stored is not None:
            return None
        return self.given.tokenizer if self.given is not None else self.checkpoint.tokenizer

    def llm(self) -> LLM:
        """The model, built now if it was given as a path."""
        if self.given is not None:
            return self.given
        if self._built is None:
            self._built = LLM.from_core(EngineCore(self.config, checkpoint=self.checkpoint))
            self.checkpoint = None           # the core holds it now
        return self._built

    def close(self) -> None:
        """Free a model this side built (one given as an LLM stays the caller's)."""
        if self._built is not None:
            self._built.close()
            self._built = None


def open_side(model: Any, options: dict | None, ctx: int, what: str, allow_stored: bool = False) -> Side:
    """Open `model` (a path or synthetic spec, an LLM, or with `allow_stored` a stored-reference file) for
    windows of `ctx` tokens; ConfigError naming `what` ("model", "reference") when it cannot serve."""
    if isinstance(model, LLM):
        if options:
            raise ConfigError(f"{what} is an LLM already built: engine options {sorted(options)} cannot apply")
        if model.max_model_len < ctx:
            raise ConfigError(f"ctx={ctx} is longer than the {what}'s max_model_len={model.max_model_len}")
        path = Path(model.config.model)
        return Side(model.config.model, path if path.exists() else None, given=model)
    if not isinstance(model, (str, Path)):
        raise ConfigError(f"{what} must be a path, a synthetic:... spec or an LLM, got {type(model).__name__}")
    if allow_stored and is_reference_file(model):
        return Side(str(model), stored=ReferenceLogprobs(model))
    if not is_synthetic(str(model)) and not Path(model).exists():
        raise ConfigError(f"{what} {model} does not exist")
    options = dict(options or {})
    if options.get("max_model_len") is not None and options["max_model_len"] < ctx:
        raise ConfigError(f"ctx={ctx} is longer than max_model_len={options['max_model_len']} asked for the {what}")
    # The KV cache holds one window, no more: windows run one at a time, and a larger pool (the CPU's default is
    # a GiB) would be written a little further each window, its pages staying resident.
    options.setdefault("max_model_len", ctx)
    config = EngineConfig.from_kwargs(str(model), **options)
    if config.num_kv_blocks is None and config.kv_cache_memory is None:
        config.num_kv_blocks = -(-ctx // config.block_size)
    checkpoint = open_checkpoint(config)
    limit = checkpoint.config.max_position_embeddings
    if ctx > limit:
        raise ConfigError(f"ctx={ctx} is longer than the {what} {model}'s context "
                          f"(max_position_embeddings={limit})")
    path = None if is_synthetic(str(model)) else Path(model)
    return Side(str(model), path, config, checkpoint)


def check_same_vocabulary(model: Side, reference: Side, sample: str) -> None:
    """ConfigError unless both sides score the same tokens: the same vocabulary size and, where both have
    a tokenizer, the same token ids for `sample`."""
    if model.vocab_size != reference.vocab_size:
        raise ConfigError(f"the reference {reference.name} has a vocabulary of {reference.vocab_size} tokens, the "
                          f"model {model.name} {model.vocab_size}: KL needs the same vocabulary")
    ours, theirs = model.tokenizer, reference.tokenizer
    if ours is None or theirs is None:
        return
    a = ours(sample, add_special_tokens=False)["input_ids"]
    b = theirs(sample, add_special_tokens=False)["input_ids"]
    if list(a) != list(b):
        raise ConfigError(f"the reference {reference.name} tokenizes the text differently from the model "
                          f"{model.name}: KL needs the same tokenizer (pass the same tokenizer= to both)")
