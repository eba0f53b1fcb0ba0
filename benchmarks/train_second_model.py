"""Train the second model of the quantization-quality table (issue 44): a small Llama on Python source code.

The default model is the only real checkpoint that travels, and its rows of 576 are not whole 128-groups or
256-element K-quant blocks. This model is trained (not random), so its weights and activations have the structure
AWQ and GPTQ exploit, and its shapes (hidden 256, intermediate 1024) take group 128 and every K-quant block.

    python benchmarks/train_second_model.py --tokenizer DIR --out /tmp/sm --seconds 330      # on a GPU
    split -b 15M -d /tmp/sm/model.safetensors $OUT/model.safetensors.part     # back in pieces; `cat` joins them
    python benchmarks/train_second_model.py --texts DIR      # DIR/calibration.txt and DIR/eval.txt, then stop

Training text: every .py file of the installed packages named by --packages (not torch: `code_text` below cuts
the calibration and evaluation text from torch's sources). Written as one float16 safetensors file (the
GPU run splits it in pieces of 15 MiB to bring it back); with the default model's tokenizer files copied beside,
a checkpoint `quanta quantize` and `quanta validate` read as it is.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from pathlib import Path

import torch


def package_files(names: list[str]) -> list[Path]:
    """The .py files of the installed packages, sorted so that a run is reproducible."""
    files = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        files += sorted(Path(spec.submodule_search_locations[0]).rglob("*.py"))
    return files


def code_text(names: list[str], max_bytes: int, skip: int = 0) -> str:
    """The concatenated sources of the packages, from file `skip` on, cut at max_bytes."""
    parts, size = [], 0
    for path in package_files(names)[skip:]:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        size += len(text)
        if size >= max_bytes:
            break
    return "\n".join(parts)[:max_bytes]


def tokens(tokenizer_dir: Path, names: list[str]) -> torch.Tensor:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in package_files(names)]
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    return torch.cat([torch.tensor(enc.ids + [0], dtype=torch.int64) for enc in encoded])


def config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=1024, num_hidden_layers=10,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
                       eos_token_id=2, torch_dtype="float16")


def train(args) -> dict:
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    ids = tokens(args.tokenizer, args.packages)
    n_val = args.val_windows * args.seqlen
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    model = LlamaForCausalLM(config()).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    steps, warmup = args.steps, 100
    gen = torch.Generator().manual_seed(0)
    start, log = time.time(), []
    step = 0
    for step in range(steps):
        # cosine decay over whichever runs out first, the steps or the seconds
        progress = min(1.0, max(step / steps, (time.time() - start) / args.seconds))
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress))
        starts = torch.randint(0, len(train_ids) - args.seqlen - 1, (args.batch,), generator=gen)
        batch = torch.stack([train_ids[s:s + args.seqlen] for s in starts.tolist()]).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(), opt.zero_grad(set_to_none=True)
        if step % 100 == 0:
            log.append((step, round(loss.item(), 4), round(time.time() - start, 1)))
            print(log[-1], flush=True)
        if progress >= 1.0:
            break
    model.eval()
    with torch.no_grad(), torch.autocast(args.device, dtype=torch.bfloat16):
        val = val_ids.view(-1, args.seqlen).to(args.device)
        val_loss = sum(model(input_ids=v[None], labels=v[None]).loss.item() for v in val) / len(val)
    model.half().save_pretrained(args.out)
    return {"tokens": len(ids), "steps": step + 1, "seconds": round(time.time() - start, 1),
            "tokens_seen": (step + 1) * args.batch * args.seqlen, "final_loss": log[-1][1] if log else None,
            "val_loss": round(val_loss, 4), "log": log, "packages": args.packages}


def write_texts(folder: Path) -> None:
    """Calibration and evaluation text of 2 MB each from torch's sources, disjoint (files 0.. and 1500..)."""
    (folder / "calibration.txt").write_text(code_text(["torch"], 2_000_000))
    (folder / "eval.txt").write_text(code_text(["torch"], 2_000_000, skip=1500))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--texts", type=Path, help="write the calibration and evaluation texts into this folder, then stop")
    p.add_argument("--tokenizer", type=Path, help="folder holding the default model's tokenizer.json")
    p.add_argument("--out", type=Path)
    p.add_argument("--packages", nargs="+", default=["transformers", "sklearn", "scipy", "pandas", "jax", "flax"])
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seqlen", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--val-windows", type=int, default=64)
    args = p.parse_args()
    if args.texts:
        return write_texts(args.texts)
    if args.tokenizer is None or args.out is None:
        p.error("--tokenizer and --out are needed to train")
    report = train(args)
    (args.out / "train.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
