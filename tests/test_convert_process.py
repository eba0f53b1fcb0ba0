"""quanta convert as a process: peak host memory stays within the bound convert's docstring states, and a
conversion killed midway (SIGTERM, SIGINT, SIGKILL) leaves no destination and the source unchanged."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 512, 2048, 8, 4, 512, 12
MiB = 1 << 20


def write_fp16_llama(path: Path, layers: int = LAYERS, hidden: int = HIDDEN, inter: int = INTER) -> dict[str, int]:
    """A plain fp16 llama checkpoint (random weights, no tokenizer) whose tensors add up to many times its
    largest (12x with the default geometry)."""
    gen = torch.Generator().manual_seed(0)
    hd = hidden // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (KV_HEADS * hd, hidden),
                   p + "self_attn.v_proj.weight": (KV_HEADS * hd, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                   p + "post_attention_layernorm.weight": (hidden,)}
    path.mkdir()
    for shard in range(2):          # two shards, as big checkpoints come
        part = {n: (0.02 * torch.randn(s, generator=gen)).half() for j, (n, s) in enumerate(shapes.items())
                if j % 2 == shard}
        save_file(part, str(path / f"model-{shard + 1:05d}-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {n: f"model-{j % 2 + 1:05d}-of-00002.safetensors"
                                            for j, n in enumerate(shapes)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
                  intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=256,
                  rms_norm_eps=1e-5, torch_dtype="float16", tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(config))
    sizes = {n: 2 * int(torch.Size(s).numel()) for n, s in shapes.items()}
    return sizes


# Runs in a fresh interpreter: for each conversion a thread samples the process's anonymous resident memory
# (RssAnon: the heap and torch's buffers, not the memory-mapped source file, whose pages the kernel reclaims
# at will); the thread starts and stops with its conversion, so no sample of one phase lands in the next.
MEASURE = r"""
import ctypes, json, sys, threading, time
import quanta, torch
libc = ctypes.CDLL("libc.so.6")

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

def peak_of(job):
    peak, done = [anon()], threading.Event()
    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], anon())
            time.sleep(0.0005)
    base = peak[0]
    thread = threading.Thread(target=sample)
    thread.start()
    job()
    time.sleep(0.05)
    done.set()
    thread.join()
    return max(peak[0], anon()) - base

src, small, out = sys.argv[1], sys.argv[2], sys.argv[3]
phases = [("awq", "SRC", "awq", "4MB", None), ("gguf", "SRC", "gguf:Q8_0", "4MB", None),
          ("awq-gptq", "awq", "gptq", "4MB", None), ("awq-gguf", "awq", "gguf:Q8_0", "4MB", None),
          ("whole", "SRC", "hf", "1GB", "float32")]
for label, source, to, _, _ in phases[:4]:      # warm-up on a one-layer model: lazy imports, first-use caches
    source = small if source == "SRC" else f"{out}/warm-{source}"
    quanta.convert(source, to, f"{out}/warm-{label}" + (".gguf" if to.startswith("gguf") else ""),
                   validate=False, quiet=True)
results = {}
for label, source, to, shard, dtype in phases:
    libc.malloc_trim(0)                         # freed heap back to the kernel, so each phase starts level
    time.sleep(0.05)
    source = src if source == "SRC" else f"{out}/{source}"
    dst = f"{out}/{label}" + (".gguf" if to.startswith("gguf") else "")
    results[label] = peak_of(lambda: quanta.convert(source, to, dst, validate=False, max_shard_size=shard,
                                                    dtype=dtype, quiet=True))
print(json.dumps(results))
"""


def test_peak_memory_stays_within_the_stated_bound(tmp_path):
    """convert's docstring: at most twice the largest tensor in float32 plus one output shard and a few MB
    of fixed scratch, never the model; for quantizing (fp16 -> AWQ, GGUF Q8_0), lossless (AWQ -> GPTQ) and
    re-quantizing (AWQ -> GGUF Q8_0) conversions. Scratch that scales with the tensor (whole-weight int64
    bit packing took about 7x) fails it. The control run buffers the whole model in one shard and must
    exceed the bound, so the measurement can see a violation."""
    sizes = write_fp16_llama(tmp_path / "src", layers=3, hidden=1024, inter=4096)
    total, largest_fp32 = sum(sizes.values()), 2 * max(sizes.values())
    assert total >= 10 * largest_fp32 / 2
    write_fp16_llama(tmp_path / "small", layers=1)
    (tmp_path / "out").mkdir()
    env = _env() | {"MALLOC_MMAP_THRESHOLD_": str(1 << 16)}     # large buffers mmapped: freed when released
    run = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "src"), str(tmp_path / "small"),
                          str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    peaks = json.loads(run.stdout.strip().splitlines()[-1])
    print({k: round(v / largest_fp32, 2) for k, v in peaks.items()}, "x the largest tensor in float32")
    fixed = 16 * MiB                 # the quantizers' chunk scratch (ggml's is the largest), allocator slack, objects
    bound = 2 * largest_fp32 + 4 * MiB + fixed           # ... + the 4MB shard
    for label in ("awq", "gguf", "awq-gptq", "awq-gguf"):
        assert peaks[label] <= bound, (label, peaks, bound, total)
    assert peaks["whole"] > bound, (peaks, bound, total)   # the control: the whole model held at once (fp32)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TQDM_DISABLE="1")


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def test_killed_conversion_leaves_no_destination_and_the_source_unchanged(tmp_path):
    """SIGTERM and SIGINT: a clean exit (128 + signal) with nothing left at DST nor beside it. SIGKILL cannot
    be handled: DST is still absent; the staging folder `.DST.tmp-*` may remain, and is never DST."""
    src = tmp_path / "src"
    write_fp16_llama(src)
    before = _digest(src)
    procs = {}
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        dst = tmp_path / f"out-{sig.name}.gguf"
        cmd = [sys.executable, "-m", "quanta.cli.main", "convert", str(src), "--to", "gguf:Q4_K_M", "--out",
               str(dst), "--no-validate", "-q"]
        # SIGINT at its default, as a terminal's Ctrl-C finds it: a test run started in the background (`pytest &`)
        # would hand the child an ignored SIGINT, which Python keeps ignoring, and the conversion would finish.
        procs[sig] = (subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)),
                      dst)
    deadline = time.monotonic() + 240
    pending = dict(procs)
    while pending and time.monotonic() < deadline:
        for sig, (proc, dst) in list(pending.items()):
            staged = list(tmp_path.glob(f".{dst.name}.tmp-*/*"))
            if any(p.name.startswith(f".{dst.name}.") for p in staged):     # the GGUF writer is writing
                assert proc.poll() is None, proc.communicate()
                proc.send_signal(sig)               # at once, before the writer commits DST
                del pending[sig]
        time.sleep(0.1)
    assert not pending, "the conversions never reached the writing stage"
    for sig, (proc, dst) in procs.items():
        out, err = proc.communicate(timeout=120)
        assert not dst.exists() and not dst.with_name(dst.name + ".convert.json").exists()
        if sig == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
            continue
        assert proc.returncode == 128 + sig, (sig, proc.returncode, err[-2000:])
        assert "nothing was written" in err
        assert not list(tmp_path.glob(f".{dst.name}*")), sig
    assert _digest(src) == before
