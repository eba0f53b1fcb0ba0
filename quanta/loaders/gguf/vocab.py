"""The tokenizer.ggml.* metadata of a GGUF file, built from a transformers (fast) tokenizer as
llama.cpp's convert_hf_to_gguf.py does (`get_vocab_base` + `_set_vocab_gpt2`, or the SentencePiece
vocabulary for byte-fallback BPE), or copied from the GGUF file the checkpoint was read from.

    tokenizer.ggml.model      "gpt2" (byte-level BPE) | "llama" (SentencePiece, byte fallback)
    tokenizer.ggml.pre        the pre-tokenizer llama.cpp applies ("smollm", "llama-bpe", ...)
    tokenizer.ggml.tokens / token_type / merges (BPE) / scores (SentencePiece)
    tokenizer.ggml.{bos,eos,unknown,padding}_token_id, add_bos_token, add_eos_token
"""
from __future__ import annotations

import json
from hashlib import sha256
from typing import Any

from quanta.quant.errors import UnsupportedError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6   # gguf.TokenType

# convert_hf_to_gguf.py `get_vocab_base_pre`: sha256 of str(tokenizer.encode(CHK_TXT)) -> pre name,
# for the tokenizers of the architectures quanta runs.
CHK_TXT = ('\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) '
           '✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ '
           '------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, '
           '\'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL')
KNOWN_PRE = {
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",
    "63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e": "tekken",
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",
}


def copied_vocab(metadata: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer.* entries of a GGUF file's metadata, to write unchanged."""
    return {k: v for k, v in metadata.items() if k.startswith("tokenizer.")}


def vocab_metadata(tok, vocab_size: int) -> dict[str, Any]:
    """tokenizer.ggml.* entries for transformers fast tokenizer `tok` over `vocab_size` ids."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise UnsupportedError(f"GGUF writer: tokenizer {type(tok).__name__} is not a fast tokenizer "
                               f"(tokenizer.json); save it with transformers' fast tokenizer first")
    spec = json.loads(backend.to_str())
    model = spec["model"]
    byte_level = "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or "ByteLevel" in json.dumps(spec.get("decoder"))
    if model["type"] != "BPE" or not (byte_level or model.get("byte_fallback")):
        raise UnsupportedError(f"GGUF writer: tokenizer model {model['type']} (byte_level={byte_level}) is not "
                               f"supported; quanta writes byte-level BPE (gpt2) and byte-fallback BPE (llama)")
    spm = not byte_level
    vocab = tok.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise UnsupportedError(f"GGUF writer: the tokenizer has id {max(vocab.values())}, beyond the model's "
                               f"vocab_size {vocab_size}")
    added = {t.content: t for t in tok.added_tokens_decoder.values()}
    by_id = {i: t for t, i in vocab.items()}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    rank = {m.replace(" ", ""): r for r, m in reversed(list(enumerate(merges)))} if spm else {}
    tokens, types, scores = [], [], []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]"), types.append(UNUSED), scores.append(-10000.0)
            continue
        if token in added:
            kind = CONTROL if added[token].special else USER_DEFINED
        elif spm and token == model.get("unk_token"):
            kind = UNKNOWN
        elif spm and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            kind = BYTE
        else:
            kind = NORMAL
        tokens.append(token.replace("▁", " ") if kind == USER_DEFINED and spm else token)
        types.append(kind)
        # SentencePiece merges the pair whose result scores highest: BPE merge rank r scores -r
        scores.append(-float(rank[token]) if token in rank else (0.0 if kind != NORMAL else -1e9))
    out: dict[str, Any] = {"tokenizer.ggml.model": "llama" if spm else "gpt2",
                           "tokenizer.ggml.pre": "default" if spm else pre_tokenizer_name(tok),
                           "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    if spm:
        out["tokenizer.ggml.scores"] = scores
    else:
        out["tokenizer.ggml.merges"] = merges
    for key, attr in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unknown", "unk_token_id"),
                      ("padding", "pad_token_id")):
        value = getattr(tok, attr, None)
        if isinstance(value, int):
            out[f"tokenizer.ggml.{key}_token_id"] = value
    ids = tok.encode("a")
    plain = tok.encode("a", add_special_tokens=False)
    out["tokenizer.ggml.add_bos_token"] = len(ids) > len(plain) and ids[0] == tok.bos_token_id
    out["tokenizer.ggml.add_eos_token"] = len(ids) > len(plain) and ids[-1] == tok.eos_token_id
    if spm:
        out["tokenizer.ggml.add_space_prefix"] = tok.encode("a", add_special_tokens=False) == tok.encode(
            " a", add_special_tokens=False)
    return out


def pre_tokenizer_name(tok) -> str:
    """llama.cpp's name for the BPE pre-tokenizer of `tok`, identified as convert_hf_to_gguf does (by
    the hash of its tokens for a fixed text); "default" when it is not one quanta knows."""
    digest = sha256(str(tok.encode(CHK_TXT)).encode()).hexdigest()
    return KNOWN_PRE.get(digest, "default")
