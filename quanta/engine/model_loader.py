"""Build the decoder on the meta device and fill it from a Checkpoint (gpt-fast's `_load_model`), streaming:
plain tensors are materialized with assign, linear weights go to QuantLinear.load (kernel pick + repack), one
module at a time. Every module must receive its tensor and every tensor must be used.
"""
from __future__ import annotations

import torch
from tqdm import tqdm

from quanta.engine.config import EngineConfig
from quanta.engine.layers import Embedding, MergedQuantLinear, QuantLinear, RMSNorm
from quanta.engine.models.llama import LlamaForCausalLM
from quanta.engine.parallel.group import TensorParallel
from quanta.loaders import detect, load
from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.pages import release
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError
from quanta.quant.group_sort import declares_act_order, group_order, sort_mlp
from quanta.quant.qtensor import QTensor


# Kernels an lm_head passes over. cpu_rows dequantizes its rows on every call: for the lm_head, often the
# model's largest matrix and read whole each step, that would outweigh the rest of a decode step.
HEAD_AVOIDS = {"cpu_rows": "the lm_head runs from one dequantized copy, not rows decoded per call"}

def open_checkpoint(cfg: EngineConfig) -> Checkpoint:
    """The checkpoint `cfg.model` names (a path or a synthetic spec): its config, tokenizer (cfg.tokenizer
    overriding the checkpoint's) and tensors, which the readers make lazily (synthetic ones on cfg.device)."""
    family = detect(cfg.model)
    if cfg.quantization not in ("auto", family):
        raise ConfigError(f"quantization={cfg.quantization!r} asked for, but {cfg.model} is {family!r}")
    # Pickle weights only with the explicit opt-in, and only the plain HF reader has one.
    options = {"hf": {"allow_pickle": True} if cfg.allow_pickle else {}, "synthetic": {"device": cfg.device}}
    ckpt = load(cfg.model, **options.get(family, {}))
    if cfg.tokenizer is not None:
        from transformers import AutoTokenizer
        ckpt.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer)
    return ckpt


def build_model(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, triton: bool = False,
                force_kernel: str | None = None, quiet: bool = False,
                lm_head_dtype: torch.dtype | None = None, tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """A ready-to-run model for `ckpt` on `device`, computing in `dtype` (the lm_head in `lm_head_dtype`,
    default `dtype`); logits come out in float32 either way. `triton`: the elementwise ops (norm, rotary,
    SiLU-and-mul) run as Triton kernels; `quiet`: no progress bar; `tp`: build this rank's shard (each
    weight is read whole, cut at once by its module, and the rest dropped).

    Streaming (DESIGN, Memory): the checkpoint's lazy mapping is read one module at a time, a merged q/k/v or
    gate/up group being one module, and no reference to a canonical tensor outlives its module's prepare();
    nothing holds the whole checkpoint. The loaders' mappings (TensorView, QuantView, the GGUF reader,
    SyntheticTensors) read on access and keep nothing they return (an opt-in pickle checkpoint is the
    exception: torch.load maps each file whole). Hence:
      - peak device memory during load ~ the final weights + the largest group's transient (its canonical
        form, their stacked copy and the kernel's repack of it);
      - peak host memory does not grow with the model: at most one group's canonical tensors are alive at
        once, and on the CPU device the final weights themselves are added to that; the mapped file pages a
        module's tensors were read from are given back once it holds its own copy (loaders.pages);
      - on a GPU, the packed HF families (AWQ and GPTQ int32 words, bitsandbytes and compressed-tensors
        bytes) are moved to the device as stored and unpacked there (Checkpoint.read_on), so no host copy
        holds a byte per weight; GGUF blocks likewise cross as stored and are converted by prepare."""
    cfg = ckpt.config
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, device, triton, tp)
    ckpt.read_on(device)                                       # packed words are unpacked on the device
    tensors = ckpt.tensors                                     # lazy: read one module's tensors at a time
    names = set(tensors)
    embed_as_head = "lm_head.weight" not in names                 # tied, or stored without one
    used: set[str] = set()

    def take(name: str, required: bool = True):
        """Read `name` from the checkpoint now (the lm_head of a tied model reads the embedding again)."""
        stored = "model.embed_tokens.weight" if name == "lm_head.weight" and embed_as_head else name
        if stored not in names:
            if required:
                raise CorruptFileError(f"{ckpt.path}: tensor {name!r} is missing from the checkpoint")
            return None
        used.add(stored)
        return tensors[stored]

    modules = list(weight_modules(model))
    early: dict[str, object] = {}                 # down_proj weights read ahead by their MLP's gate_up_proj
    sort_groups = declares_act_order(ckpt.quant_config)     # until an MLP shows no act-order down_proj
    for name, module in tqdm(modules, desc="loading", disable=quiet, leave=False):
        if isinstance(module, MergedQuantLinear):
            parts = module.part_names(name)
            weights = [take(f"{n}.weight") for n in parts]
            biases = [take(f"{n}.bias", module.has_bias) for n in parts]
            if sort_groups and name.endswith("mlp.gate_up_proj"):    # act-order groups: see group_sort
                down = name.removesuffix("gate_up_proj") + "down_proj.weight"
                early[down] = take(down)
                sort_groups = group_order(early[down]) is not None
                gate, up, early[down], *biases = sort_mlp(*weights, early[down], *biases)
                weights = [gate, up]
                del gate, up            # the sorted whole copies must die with `weights`, after this load
            module.load(weights, biases, device, dtype, names=[f"{n}.weight" for n in parts],
                        force_kernel=force_kernel)
            release(weights + biases, keep=[layer.state for _, layer in module.linears()])
            del weights
        elif isinstance(module, QuantLinear):
            head = module is model.lm_head
            module_dtype = (lm_head_dtype or dtype) if head else dtype
            weight = early.pop(f"{name}.weight", None)
            table = model.model.embed_tokens.table
            if weight is None and head and embed_as_head and isinstance(table, torch.Tensor) and tp is None:
                weight = table                  # tied: one plain table for both, no second read and no second copy
                if device.type == "cpu" and table.element_size() == 2 and module_dtype.itemsize == 2:
                    module_dtype = table.dtype  # a 16-bit lm_head on the CPU computes in the table's own 16 bits
            weight = take(f"{name}.weight") if weight is None else weight
            module.load(weight, take(f"{name}.bias", module.has_bias), device, module_dtype, name=f"{name}.weight",
                        force_kernel=force_kernel, avoid=HEAD_AVOIDS if head else None)
            if head:
                table = _tie_head(model, module, table, embed_as_head and tp is None)
            release(weight, keep=[module.state, table])
            del weight
        elif isinstance(module, Embedding):
            module.load(take(f"{name}.weight"), device, dtype)
        else:
            weight = take(f"{name}.weight")
            if tuple(weight.shape) != tuple(module.weight.shape):
                raise ShapeError(f"{name}.weight: shape {list(weight.shape)} != {list(module.weight.shape)}")
            module.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype), requires_grad=False)
            del weight                   # the canonical tensor dies with its module's load
    unused = sorted(names - used - {"lm_head.weight"})
    unused = [n for n in unused if not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise CorruptFileError(f"{ckpt.path}: {len(unused)} tensors match no module of {cfg.model_type}, "
                               f"e.g. {unused[:3]}")
    for layer in model.model.layers:
        layer.feed_in_weight_order()
    return model.eval()


def _tie_head(model: LlamaForCausalLM, head: QuantLinear, table, tied: bool):
    """After the lm_head's load. Where its kernel computes in float32 or from 8-bit blocks whatever its input (the
    CPU's native ones), it takes float32 activations and gives float32 logits: a 16-bit dtype would only round
    both. Where it is tied to a quantized embedding and its state gives rows back (take_rows), the embedding reads
    them there and lets its own copy of the table go. Returns the table the embedding holds now."""
    if head.compute_dtype() in (torch.float32, torch.int8):
        head.dtype = torch.float32
    if tied and isinstance(table, QTensor) and hasattr(head.state, "take_rows"):
        model.model.embed_tokens.read_rows_from(head.state)
        release(table, keep=[head.state])
        return head.state
    return table


def weight_modules(module: torch.nn.Module, prefix: str = ""):
    """(name, module) of every module that takes checkpoint tensors, in model order; a MergedQuantLinear
    counts as one (the layers inside it are its own business)."""
    for name, child in module.named_children():
        if isinstance(child, (MergedQuantLinear, QuantLinear, RMSNorm, Embedding)):
            yield prefix + name, child
        else:
            yield from weight_modules(child, f"{prefix}{name}.")

