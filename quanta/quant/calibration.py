"""Calibration data and a layer-at-a-time float32 runner of a llama-family model, for AWQ / GPTQ / FP8.

    data = load_calibration(tokenizer, path=DEFAULT_TEXT, n_samples=128, seqlen=512)   # CalibrationData
    runner = LayerRunner(model_config)
    layer = runner.build(i, {"self_attn.q_proj.weight": tensor, ...})    # transformers decoder layer
    y = runner.forward(layer, x)                                         # x, y [n_samples, seqlen, hidden]
    runner.capture(layer, x, {"self_attn.q_proj": fn, ...})              # fn(chunk_input) per linear
    runner.attention(layer)                                              # x -> the attention output, a callable
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quanta.quant.errors import ConfigError, UnsupportedError

DEFAULT_TEXT = Path("/work/shared/data/wikitext-2-raw-test.txt")
LAYER_CLASSES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


@dataclass
class CalibrationData:
    """Token windows [n_samples, seqlen] (long) that the model is run on."""
    tokens: torch.Tensor

    @property
    def n_samples(self) -> int:
        return self.tokens.shape[0]

    @property
    def seqlen(self) -> int:
        return self.tokens.shape[1]


def load_calibration(tokenizer, path: str | Path = DEFAULT_TEXT, n_samples: int = 128, seqlen: int = 512,
                     max_chars: int | None = None) -> CalibrationData:
    """`n_samples` windows of `seqlen` tokens, spread evenly over the tokenized text file at `path`.

    ConfigError when the file is missing or holds fewer than n_samples * seqlen tokens (the message says
    how many it holds). `max_chars` reads only the start of the file (faster for small runs).
    """
    if n_samples <= 0 or seqlen <= 1:
        raise ConfigError(f"calibration: n_samples must be > 0 and seqlen > 1, got {n_samples} and {seqlen}")
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"calibration text {path} does not exist")
    text = path.read_text(encoding="utf-8", errors="replace")
    if max_chars is not None:
        text = text[:max_chars]
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    need = n_samples * seqlen
    if ids.numel() < need:
        raise ConfigError(f"calibration text {path} has {ids.numel()} tokens, fewer than n_samples * seqlen = "
                          f"{n_samples} * {seqlen}; use fewer or shorter samples or a longer text")
    stride = (ids.numel() - seqlen) // max(n_samples - 1, 1)
    starts = [i * stride for i in range(n_samples)]
    return CalibrationData(torch.stack([ids[s:s + seqlen] for s in starts]))


def hf_config(cfg):
    """A transformers config (fp32, sdpa attention) of the llama-family ModelConfig `cfg`, from the same
    config.json dict the writers save (ModelConfig.to_hf_dict)."""
    from transformers import AutoConfig

    fields = cfg.to_hf_dict()
    fields.pop("architectures")
    hf = AutoConfig.for_model(fields.pop("model_type"), **fields)
    hf._attn_implementation = "sdpa"
    return hf


class LayerRunner:
    """Builds and runs one decoder layer at a time in float32, on `device` (the CPU by default).

    The layer is transformers' own decoder layer class for the architecture (LlamaDecoderLayer,
    Qwen2DecoderLayer, ...), built from the checkpoint's ModelConfig, so the math is the reference's.
    Only one layer's weights exist in float32 at a time; samples run in chunks of `chunk` sequences
    under an explicit causal (and sliding-window) mask."""

    def __init__(self, cfg, chunk: int = 8, device: torch.device | str = "cpu"):
        if cfg.model_type not in LAYER_CLASSES:
            raise UnsupportedError(f"calibration: no decoder layer for model_type {cfg.model_type!r} "
                                   f"(supported: {', '.join(LAYER_CLASSES)})")
        self.cfg, self.chunk, self.device = cfg, chunk, torch.device(device)
        self.hf = hf_config(cfg)
        prefix = LAYER_CLASSES[cfg.model_type]
        module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
        self.layer_class = getattr(module, f"{prefix}DecoderLayer")
        self.rotary = getattr(module, f"{prefix}RotaryEmbedding")(config=self.hf).to(self.device)
        self._pos: dict[int, tuple] = {}

    def build(self, index: int, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        """Layer `index` holding `weights` (names relative to the layer, float32) on the runner's device; strict
        about names."""
        with torch.device(self.device):
            layer = self.layer_class(self.hf, index).float().eval()
        missing, unexpected = layer.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise ConfigError(f"layer {index}: checkpoint tensors do not fit a {self.layer_class.__name__}: "
                              f"missing {missing}, unexpected {unexpected}")
        return layer.requires_grad_(False)

    def _position(self, seqlen: int, like: torch.Tensor):
        if seqlen not in self._pos:
            pos = torch.arange(seqlen, device=like.device).unsqueeze(0)
            cos, sin = self.rotary(like[:1, :seqlen].float(), pos)
            i = torch.arange(seqlen, device=like.device)
            visible = i.view(1, -1) <= i.view(-1, 1)
            if self.cfg.sliding_window:
                visible &= i.view(1, -1) > i.view(-1, 1) - self.cfg.sliding_window
            mask = torch.zeros(seqlen, seqlen, device=like.device).masked_fill(~visible, float("-inf"))
            mask = mask.view(1, 1, seqlen, seqlen)
            self._pos[seqlen] = ((cos, sin), mask, pos)
        return self._pos[seqlen]

    def _chunked(self, fn: Callable, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([fn(x[i:i + self.chunk]) for i in range(0, x.shape[0], self.chunk)])

    @torch.no_grad()
    def forward(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for hidden states x [n, T, hidden]."""
        emb, mask, pos = self._position(x.shape[1], x)
        return self._chunked(lambda c: _first(layer(c, attention_mask=mask, position_ids=pos,
                                                    position_embeddings=emb)), x)

    def attention(self, layer: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """x (the normalized input of q/k/v) -> self-attention output, chunked."""
        def run(x):
            emb, mask, pos = self._position(x.shape[1], x)
            return self._chunked(lambda c: _first(layer.self_attn(hidden_states=c, attention_mask=mask,
                                                                  position_ids=pos, position_embeddings=emb)), x)
        return torch.no_grad()(run)

    def position_embeddings(self, seqlen: int, like: torch.Tensor):
        """(cos, sin) of positions 0..seqlen-1, as the layer receives them."""
        return self._position(seqlen, like)[0]

    @torch.no_grad()
    def capture(self, layer: torch.nn.Module, x: torch.Tensor, hooks: dict[str, Callable],
                outputs: dict[str, Callable] | None = None) -> torch.Tensor:
        """Run the layer on x, calling hooks[name](input chunk) on each named submodule's input and
        outputs[name](output chunk) on its output; returns the layer output."""
        handles = [layer.get_submodule(n).register_forward_pre_hook(lambda m, a, fn=fn: fn(a[0]))
                   for n, fn in hooks.items()]
        handles += [layer.get_submodule(n).register_forward_hook(lambda m, a, out, fn=fn: fn(out))
                    for n, fn in (outputs or {}).items()]
        try:
            return self.forward(layer, x)
        finally:
            for h in handles:
                h.remove()


def _first(out):
    return out[0] if isinstance(out, tuple) else out
