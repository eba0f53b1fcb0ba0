"""The outside baseline of quant_quality.sh: llm-compressor's FP8_DYNAMIC (e4m3 per-channel weights, dynamic
per-token activations) on a float32 HF folder, by round-to-nearest or by GPTQ (its defaults: actorder
"static", dampening 0.01, blocksize 128), on the calibration windows quanta itself uses.

Runs in a venv with llmcompressor (not quanta's), e.g.
    python3 -m venv /work/venv-fp8 && /work/venv-fp8/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1
    /work/venv-fp8/bin/python benchmarks/llmc_fp8.py HF32_DIR OUT_DIR rtn|gptq SUMMARY.json [TOKENS.pt]
TOKENS.pt: a [n_samples, seqlen] long tensor of calibration token ids (gptq only; quant_quality.sh writes
it with quanta's load_calibration). Writes OUT_DIR (compressed-tensors) and, in SUMMARY.json, the keys of
`quanta quantize --json` that quant_quality.sh's table reads (llm-compressor logs to stdout).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch  # noqa: E402

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.")


def linear_bits(out: Path) -> float:
    """Stored bits of the decoder linears' tensors (weights and scales) per linear weight."""
    from safetensors import safe_open

    stored = weights = 0
    for shard in out.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                if LINEAR.match(name):
                    t = f.get_slice(name)
                    n = 1
                    for d in t.get_shape():
                        n *= d
                    stored += n * {"F8_E4M3": 1, "F32": 4, "F16": 2, "BF16": 2}[t.get_dtype()]
                    weights += n if name.endswith(".weight") else 0
    return 8 * stored / weights


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    src, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    start = time.perf_counter()
    if mode == "rtn":
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
    else:
        from datasets import Dataset

        ids = torch.load(sys.argv[5])
        data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
        recipe = GPTQModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
        oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=ids.shape[0],
                max_seq_length=ids.shape[1], shuffle_calibration_samples=False)
    seconds = time.perf_counter() - start
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    scheme = f"llm-compressor {version('llmcompressor')} FP8_DYNAMIC{' GPTQ' * (mode == 'gptq')} -> compressed-tensors"
    summary = {"out": str(out), "scheme": scheme, "seconds": seconds, "linear_bits_per_weight": linear_bits(out),
               "bytes_on_disk": sum(f.stat().st_size for f in out.rglob("*") if f.is_file())}
    Path(sys.argv[4]).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
