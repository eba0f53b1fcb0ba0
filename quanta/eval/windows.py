"""Token windows for perplexity: the text tokenized once, cut into windows of `ctx` tokens.

The default follows llama.cpp's `perplexity`: the whole file is read as one string (newlines kept) and
tokenized in one go; windows of `ctx` tokens start every `ctx` tokens (no overlap); where the model's
tokenizer adds a BOS token, the first token of every window is replaced by BOS, so each window starts
as a fresh sequence would. Only the second half of each window is scored (score="second-half"): the
tokens at positions ctx/2 .. ctx-1, each predicted from every token before it in the window, so each
scored token has at least ctx/2 tokens of context. llama.cpp scores one token fewer (positions
ctx/2+1 .. ctx-1); the difference is the first scored token's. score="all" scores positions 1 .. ctx-1.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from quanta.quant.errors import ConfigError

DEFAULT_TEXT = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2-raw-test.txt"
SCORES = ("second-half", "all")


@dataclass(slots=True)
class WindowSpec:
    """How the text is cut and scored. `stride`: tokens between window starts (default ctx, no overlap);
    `n_windows`: the first N windows (default: every window that fits)."""
    ctx: int = 512
    stride: int | None = None
    n_windows: int | None = None
    score: str = "second-half"

    def __post_init__(self):
        if not isinstance(self.ctx, int) or self.ctx < 2:
            raise ConfigError(f"ctx must be an integer >= 2, got {self.ctx!r}")
        if self.stride is None:
            self.stride = self.ctx
        if not isinstance(self.stride, int) or self.stride < 1:
            raise ConfigError(f"stride must be a positive integer, got {self.stride!r}")
        if self.n_windows is not None and (not isinstance(self.n_windows, int) or self.n_windows < 1):
            raise ConfigError(f"n_windows must be a positive integer, got {self.n_windows!r}")
        if self.score not in SCORES:
            raise ConfigError(f"score {self.score!r} is not one of {', '.join(SCORES)}")

    @property
    def first_scored(self) -> int:
        """Position of the first scored token in a window (the ones before it are context only)."""
        return self.ctx // 2 if self.score == "second-half" else 1


@dataclass(slots=True)
class TokenWindows:
    """The windows' token ids (each `spec.ctx` long) and what they came from."""
    spec: WindowSpec
    windows: list[list[int]]
    text_tokens: int                 # tokens in the whole text
    bos_token_id: int | None         # the BOS every window starts with, or None

    @property
    def scored_per_window(self) -> int:
        return self.spec.ctx - self.spec.first_scored

    def fingerprints(self) -> list[str]:
        """A short hash of each window's token ids: stored reference logits are matched against them."""
        return [hashlib.sha256(" ".join(map(str, w)).encode()).hexdigest()[:16] for w in self.windows]


def read_text(path: str | Path | None) -> tuple[Path, str]:
    """(path, contents) of the evaluation text (default: WikiText-2 raw test); ConfigError when missing."""
    path = Path(path) if path is not None else DEFAULT_TEXT
    if not path.is_file():
        hint = "" if path != DEFAULT_TEXT else " (the default WikiText-2 test file; pass text=PATH)"
        raise ConfigError(f"text file {path} does not exist{hint}")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ConfigError(f"text file {path} is empty")
    return path, text


def adds_bos(tokenizer) -> int | None:
    """The BOS id the tokenizer puts in front of a text, or None when it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    with_special = tokenizer("a")["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos if bos is not None and len(with_special) > len(plain) and with_special[0] == bos else None


def tokenize(tokenizer, text: str, spec: WindowSpec) -> TokenWindows:
    """Tokenize `text` as one string and cut it as `spec` says; ConfigError when it has fewer tokens than
    one window."""
    if tokenizer is None:
        raise ConfigError("the model has no tokenizer: pass tokenizer=DIR (--tokenizer) to evaluate on text")
    bos = adds_bos(tokenizer)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if bos is not None:
        ids = [bos] + ids
    available = 0 if len(ids) < spec.ctx else (len(ids) - spec.ctx) // spec.stride + 1
    if available == 0:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than one window of ctx={spec.ctx}")
    count = available if spec.n_windows is None else spec.n_windows
    if count > available:
        raise ConfigError(f"n_windows={count} asked for, but the text holds only {available} windows of "
                          f"ctx={spec.ctx} (stride {spec.stride}, {len(ids)} tokens)")
    windows = []
    for i in range(count):
        window = ids[i * spec.stride: i * spec.stride + spec.ctx]
        if bos is not None:
            window[0] = bos
        windows.append(window)
    return TokenWindows(spec, windows, len(ids), bos)
