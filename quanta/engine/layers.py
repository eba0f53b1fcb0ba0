"""The model's building blocks: QuantLinear (any weight kind, through the kernel registry) and
MergedQuantLinear (q/k/v or gate/up as one GEMM), RMSNorm (fused with the residual add), a
(quantized-aware) embedding, rotary position embedding (default, linear, llama3) and SiLU-and-mul.

The norm, rotary and SiLU-and-mul run as Triton kernels (quanta.kernels) or as their torch references,
which compute what transformers computes, as each module is told by its `triton` flag at construction:
the engine decides it once for the whole model and its KV cache with
`quanta.kernels.device_caps.use_triton`, so no two ops can disagree.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quanta.kernels import activation, fused_norm, registry, rotary
from quanta.cpu import layer_ops as cpu_layer_ops
from quanta.quant.errors import ShapeError, UnsupportedError
from quanta.quant.qtensor import QTensor, cat_rows
from quanta.quant.shard import cut


@dataclass(frozen=True)
class Cut:
    """This rank's piece of a checkpoint weight under tensor parallelism: along `dim` (0: output rows,
    column-parallel; 1: input columns, row-parallel) the range [start, stop) of `full`. A row-parallel
    layer's bias is added once, by the rank with `keep_bias`."""
    dim: int
    start: int
    stop: int
    full: int
    keep_bias: bool = True

    def weight(self, w, name: str):
        """(piece, (left, right)): the piece of `w` (read whole from the checkpoint), cut before anything else
        touches it, and the zero input columns a row-parallel piece widened to whole groups or blocks takes on
        each side of this rank's input (shard.widened_cols)."""
        if w.shape[self.dim] != self.full:
            raise ShapeError(f"{name}: weight shape {list(w.shape)} has {w.shape[self.dim]} "
                             f"{'rows' if self.dim == 0 else 'columns'}, expected {self.full}")
        return cut(w, self.dim, self.start, self.stop, name)

    def bias(self, b: torch.Tensor | None) -> torch.Tensor | None:
        if b is None or self.dim == 1:
            return b if self.keep_bias else None
        return b[self.start:self.stop]


def lora_fuses(kernel, state, slots, x: torch.Tensor) -> bool:
    """Whether the kernel's path for x's rows adds adapter products in its epilogue (its `lora_fuses`), for slots
    the Triton kernels read."""
    fuses = getattr(kernel, "lora_fuses", None)
    return fuses is not None and slots.stacked and fuses(state, x.numel() // x.shape[-1])


def lora_epilogue(kernel, state, slots, step, x: torch.Tensor):
    """The step's adapter products for x's rows as the kernel's epilogue (quanta.lora.slots.LayerSlots.epilogue:
    the shrink runs now, the kernel adds the expand to its output), or None where the kernel's path for these rows
    takes none (lora_fuses); the caller then adds them after the kernel (LayerSlots.add)."""
    if not lora_fuses(kernel, state, slots, x):
        return None
    return slots.epilogue(x.reshape(-1, x.shape[-1]), step)


class QuantLinear(nn.Module):
    """y = x @ W.T + b for W a plain tensor or any QTensor; the kernel is picked once at load. Under
    tensor parallelism `cut` says which piece of the checkpoint's weight this rank holds (in/out_features
    are the piece's); a row-parallel layer returns this rank's partial sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, cut: Cut | None = None):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.cut = cut
        self.kernel = None
        self.kernel_reason = ""
        self.dtype: torch.dtype | None = None      # what the kernel computes in, set at load
        self.scheme = "unloaded"
        self.state = None
        self.bias: torch.Tensor | None = None
        self.stored_bytes = 0                       # the canonical weight's bytes, as read from the checkpoint
        self.pad = (0, 0)                           # zero input columns before / after x (a widened TP piece)
        self.lora = self.lora_step = None           # adapter slots (quanta.lora.slots), when LoRA is enabled

    def load(self, weight: torch.Tensor | QTensor, bias: torch.Tensor | None, device: torch.device,
             dtype: torch.dtype, name: str = "", force_kernel: str | None = None,
             avoid: dict[str, str] | None = None) -> None:
        """Check the weight's shape, cut this rank's piece, pick its kernel (registry.select's `force` and
        `avoid`) and repack it into its layout."""
        if self.has_bias != (bias is not None):
            raise ShapeError(f"{name}: bias {'missing' if self.has_bias else 'unexpected'}")
        if self.cut is not None:
            (weight, self.pad), bias = self.cut.weight(weight, name), self.cut.bias(bias)
        shape = tuple(weight.shape)
        if shape != (self.out_features, self.in_features + sum(self.pad)):
            raise ShapeError(f"{name}: weight shape {list(shape)} != expected "
                             f"{[self.out_features, self.in_features + sum(self.pad)]}")
        self.dtype = dtype
        self.kernel, self.kernel_reason = registry.select(weight, device, dtype, force=force_kernel, avoid=avoid)
        self.scheme = weight.describe() if isinstance(weight, QTensor) else f"dense {weight.dtype}"
        self.stored_bytes = weight.nbytes if isinstance(weight, QTensor) else weight.numel() * weight.element_size()
        self.state = self.kernel.prepare(weight, device, dtype)
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad != (0, 0):
            x = F.pad(x, self.pad)
        if self.lora is None or not self.lora_step.active:
            return self.kernel.apply(x, self.state, self.bias)
        epilogue = lora_epilogue(self.kernel, self.state, self.lora, self.lora_step, x)
        if epilogue is not None:
            return self.kernel.apply(x, self.state, self.bias, lora=epilogue)
        return self.lora.add(x, self.kernel.apply(x, self.state, self.bias), self.lora_step)

    def takes_fp8_rows(self, m: int) -> bool:
        """Whether m rows of input may come as fp8_gemm.Fp8Rows (quantized by the launch that made them): a W8A8
        kernel at this M (its takes_fp8_rows), no padding, no adapter this step."""
        takes = getattr(self.kernel, "takes_fp8_rows", None)
        return (takes is not None and self.pad == (0, 0) and (self.lora is None or not self.lora_step.active)
                and takes(self.state, m))

    def compute_dtype(self) -> torch.dtype:
        """What the GEMM's arithmetic runs in: the kernel's declared compute_dtype of the layer's dtype, else that."""
        declared = getattr(self.kernel, "compute_dtype", None)
        return declared(self.dtype) if declared is not None else self.dtype

    def attach_lora(self, slots, step) -> None:
        """Add each token's adapter products (quanta.lora.slots.LayerSlots, read by `step`) to the output."""
        self.lora, self.lora_step = slots, step

    def take_input_order(self) -> torch.Tensor | None:
        """The order (int32 [K]: input column k reads feature order[k]) in which this layer's kernel would gather
        its input, handed to the caller, which from now on passes inputs already in it; None where the kernel
        reads its input in the model's order (kernels may expose take_input_order, see the registry)."""
        take = getattr(self.kernel, "take_input_order", None)
        if take is None:
            return None
        order, self.state = take(self.state)
        return order

    def extra_repr(self) -> str:
        kernel = self.kernel.NAME if self.kernel else None
        return f"{self.in_features}->{self.out_features}, {self.scheme}, kernel={kernel}"


def stack_runs(weights: list) -> list[list[int]]:
    """The parts in runs of neighbours that cat_rows stacks (q and k of one type, v of another: [[0, 1], [2]]), so
    that weights of a mixed file run as few GEMMs as their formats allow."""
    return [run for run, _ in stacked_runs(weights)]


def stacked_runs(weights: list) -> list[tuple[list[int], object]]:
    """stack_runs' runs, each with its weight (the run's parts stacked by cat_rows, or the one part)."""
    runs = [([0], weights[0])]
    for i in range(1, len(weights)):
        stacked = cat_rows([runs[-1][1], weights[i]])
        if stacked is not None:
            runs[-1] = (runs[-1][0] + [i], stacked)
        else:
            runs.append(([i], weights[i]))
    return runs


class MergedQuantLinear(nn.Module):
    """Linear layers over one input (q/k/v, gate/up) run as one GEMM on their stacked weight, so a decode
    step reads one larger weight with one launch; weights that cannot share a format (say, different
    act-order permutations, or a mixed GGUF file's q, k in one type and v in another) stay separate layers, as
    few as stack_runs allows, their outputs concatenated or made in one launch where their kernel's apply_rows
    can. `triton`: whether SiLU-and-mul, where the GEMM cannot fuse it, runs as the Triton kernel. `cuts`: under
    tensor parallelism, each part's rows this rank holds (`parts` then gives the pieces' sizes); each part is cut
    on its own."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False, triton: bool = False,
                 cuts: list[Cut] | None = None):
        super().__init__()
        self.in_features, self.parts, self.has_bias, self.triton = in_features, dict(parts), bias, triton
        self.cuts = cuts
        self.sizes = list(self.parts.values())
        self.fused = QuantLinear(in_features, sum(self.sizes), bias)
        self.separate: nn.ModuleList | None = None
        self.groups: list[list[int]] = []             # the parts each separate layer stacks (stacked_runs)
        self.rows_bias: torch.Tensor | None = None    # the separate layers' biases, stacked
        self.input_order: torch.Tensor | None = None     # the order its input arrives in (take_input_order)
        self.lora = self.lora_step = None
        self.pending = None          # (the norm's output, its LoRAEpilogue) when the norm feeding this made the shrink

    def load(self, weights: list, biases: list, device: torch.device, dtype: torch.dtype,
             names: list[str], force_kernel: str | None = None) -> None:
        """Cut this rank's piece of each part, then stack them when cat_rows can (exactly), else load each
        part on its own."""
        if self.cuts is not None:
            for b, name in zip(biases, names):
                if self.has_bias != (b is not None):
                    raise ShapeError(f"{name}: bias {'missing' if self.has_bias else 'unexpected'}")
            weights = [c.weight(w, name)[0] for c, w, name in zip(self.cuts, weights, names)]   # rows: no pad
            biases = [c.bias(b) for c, b in zip(self.cuts, biases)]
        for w, b, n, name in zip(weights, biases, self.sizes, names):
            if tuple(w.shape) != (n, self.in_features):
                raise ShapeError(f"{name}: weight shape {list(w.shape)} != expected {[n, self.in_features]}")
            if self.has_bias != (b is not None):
                raise ShapeError(f"{name}: bias {'missing' if self.has_bias else 'unexpected'}")
        merged = cat_rows(weights)
        if merged is not None:
            bias = torch.cat(biases) if self.has_bias else None
            self.fused.load(merged, bias, device, dtype, name="+".join(names), force_kernel=force_kernel)
            return
        self.fused = None
        runs = stacked_runs(weights)
        self.groups = [group for group, _ in runs]
        self.separate = nn.ModuleList()
        for group, weight in runs:
            layer = QuantLinear(self.in_features, sum(self.sizes[i] for i in group), self.has_bias)
            bias = torch.cat([biases[i] for i in group]) if self.has_bias else None
            layer.load(weight, bias, device, dtype, name="+".join(names[i] for i in group), force_kernel=force_kernel)
            self.separate.append(layer)
        self.rows_bias = torch.cat([layer.bias for layer in self.separate]) if self.has_bias else None

    def _rows(self, x: torch.Tensor, rope=None) -> torch.Tensor | None:
        """The separate layers in one launch (their kernel's apply_rows, where all share one kernel that has it;
        with rope, its rotary + KV-store epilogue), or None where it cannot."""
        kernel = self.separate[0].kernel
        rows = getattr(kernel, "apply_rows", None)
        if rows is None or any(layer.kernel is not kernel for layer in self.separate):
            return None
        return rows(x, [layer.state for layer in self.separate], self.rows_bias, rope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., K] -> [..., sum of the parts' N], the parts in order (plus the tokens' adapter products)."""
        epilogue = self._epilogue(x)
        if epilogue is not None:
            return self.fused.kernel.apply(x, self.fused.state, self.fused.bias, lora=epilogue)
        if self.fused is not None:
            y = self.fused(x)
        else:
            y = self._rows(x)
            if y is None:
                y = torch.cat([layer(x) for layer in self.separate], dim=-1)
        return self.lora.add(x, y, self.lora_step) if self._adapted() else y

    def attach_lora(self, slots, step) -> None:
        """Add each token's adapter products (quanta.lora.slots.LayerSlots, read by `step`) to the parts'
        outputs; the epilogues that would consume the output inside the GEMM (SwiGLU, rotary) then step aside."""
        self.lora, self.lora_step = slots, step

    def _adapted(self) -> bool:
        return self.lora is not None and self.lora_step.active

    def _epilogue(self, x: torch.Tensor):
        """The adapter products as the stacked GEMM's epilogue for x's rows (lora_epilogue), None where this step
        has none or the GEMM's path for these rows cannot add them; the one the norm made with x, if it did."""
        pending, self.pending = self.pending, None
        if not self._fuses(x):
            return None
        if pending is not None and pending[0] is x:
            return pending[1]
        return self.lora.epilogue(x.reshape(-1, x.shape[-1]), self.lora_step)

    def _fuses(self, x: torch.Tensor) -> bool:
        """Whether this step's adapters reach x's rows in the stacked GEMM's epilogue (lora_fuses)."""
        return self._adapted() and self.fused is not None and lora_fuses(self.fused.kernel, self.fused.state,
                                                                          self.lora, x)

    def norm_shrink(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None):
        """The Triton norm's output (y, or (y, h)) made by the launch that also makes this GEMM's LoRA shrink (kept
        for its epilogue), where this step's rows take a LoRA epilogue; else None (the caller runs the norm)."""
        if not self._fuses(x):
            return None
        out, epilogue = self.lora.norm_shrink(x, weight, eps, residual, self.lora_step)
        self.pending = (out if residual is None else out[0], epilogue)
        return out

    def forward_glu(self, x: torch.Tensor, fp8_rows: bool = False):
        """silu_and_mul(self(x)) for the parts (gate, up), fused into the GEMM where its kernel can (adapter
        products too, where its epilogue adds them). `fp8_rows`: the reader takes fp8_gemm.Fp8Rows, which this
        returns where its own kernel makes them (one with takes_fp8_rows: it decides by its state and x's rows); else
        a tensor."""
        fused_glu = getattr(self.fused.kernel, "apply_glu", None) if self.fused is not None else None
        if fused_glu is not None:
            if not self._adapted():
                if fp8_rows and hasattr(self.fused.kernel, "takes_fp8_rows"):
                    return fused_glu(x, self.fused.state, self.fused.bias, fp8_rows=True)
                return fused_glu(x, self.fused.state, self.fused.bias)
            epilogue = self._epilogue(x)
            if epilogue is not None:
                return fused_glu(x, self.fused.state, self.fused.bias, lora=epilogue)
        return silu_and_mul(self.forward(x), self.triton)

    def forward_rope_store(self, x: torch.Tensor, rope) -> torch.Tensor | None:
        """self(x) for the parts (q, k, v) with q and k rotated and k, v stored in the paged caches by the GEMM's
        epilogue (rotary.RopeStore): [..., sum of N] whose q columns hold the rotated q. None where its kernel
        cannot for this input; the caller then runs self(x) and the rotary kernel."""
        if self.fused is None:
            return self._rows(x, rope) if not self._adapted() else None
        fused = getattr(self.fused.kernel, "apply_rope_store", None)
        if fused is None:
            return None
        if not self._adapted():
            return fused(x, self.fused.state, self.fused.bias, rope)
        epilogue = self._epilogue(x)
        return fused(x, self.fused.state, self.fused.bias, rope, lora=epilogue) if epilogue is not None else None

    def take_input_order(self) -> torch.Tensor | None:
        """QuantLinear.take_input_order of the stacked GEMM; None for parts loaded separately."""
        self.input_order = self.fused.take_input_order() if self.fused is not None else None
        return self.input_order

    def part_names(self, name: str) -> list[str]:
        """The parts' checkpoint names for this module registered as `name` (e.g. `...self_attn.qkv_proj`
        -> `...self_attn.q_proj`, `...k_proj`, `...v_proj`)."""
        parent = name.rsplit(".", 1)[0]
        return [f"{parent}.{part}" for part in self.parts]

    def linears(self) -> list[tuple[str, QuantLinear]]:
        """(part name(s), layer) for each GEMM this module runs."""
        if self.fused is not None:
            return [("+".join(self.parts), self.fused)]
        parts = list(self.parts)
        return [("+".join(parts[i] for i in group), layer) for group, layer in zip(self.groups, self.separate)]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as transformers' LlamaRMSNorm; with `residual`, the residual add
    before it is fused in (vLLM's form): returns (normed, x + residual). `triton`: the Triton kernel runs
    (for rows laid out contiguously), else the torch reference. After `write_in_order`, the normed output's
    features come in the order of the one layer that reads them (fused_norm's `order`)."""

    def __init__(self, dim: int, eps: float, triton: bool = False):
        super().__init__()
        self.eps, self.triton = eps, triton
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.order: torch.Tensor | None = None      # int32 [dim]: the feature output column k holds
        self.feeds = None        # the MergedQuantLinear that reads the output, when it may take its LoRA shrink here

    def feed_lora(self, layer) -> None:
        """Let `layer` (the MergedQuantLinear that reads this norm's output) take its LoRA shrink from this norm's
        launch. A plain reference, not a submodule: the layer has its own place in the model."""
        object.__setattr__(self, "feeds", layer)

    def write_in_order(self, order: torch.Tensor) -> None:
        """From now on write the normed output's column k as feature order[k] (a QuantLinear's
        take_input_order), for the single layer that reads it."""
        self.order = order.to(torch.int32)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.triton and x.stride(-1) == 1:
            if self.feeds is not None and self.order is None:
                out = self.feeds.norm_shrink(x, self.weight, self.eps, residual)
                if out is not None:
                    return out
            return fused_norm.rms_norm(x, self.weight, self.eps, residual, self.order)
        if self.order is None and cpu_layer_ops.usable(x):
            return cpu_layer_ops.rms_norm(x, self.weight, self.eps, residual)
        return fused_norm.reference(x, self.weight, self.eps, residual, self.order)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, the new residual stream): x + residual, or x itself where there is no residual yet."""
        return (self(x), x) if residual is None else self(x, residual)


def silu_and_mul(x: torch.Tensor, triton: bool) -> torch.Tensor:
    """SwiGLU's gate: silu(x[..., :I]) * x[..., I:] for the fused gate_up output, on the Triton kernel or
    the torch reference."""
    if triton:
        return activation.silu_and_mul(x)
    if cpu_layer_ops.usable(x):
        return cpu_layer_ops.silu_and_mul(x)
    return activation.reference(x)


class Embedding(nn.Module):
    """Token embedding over a plain or quantized table; quantized rows are decoded on lookup. Vocab-parallel
    under tensor parallelism: this rank holds the rows of `cut`, looks up the ids that fall in them (zeros
    for the others): its output is this rank's partial sum of the ranks' lookups."""

    def __init__(self, vocab_size: int, dim: int, cut: Cut | None = None):
        super().__init__()
        self.vocab_size, self.dim, self.cut = vocab_size, dim, cut
        self.table: torch.Tensor | QTensor | None = None
        self.stored_bytes = 0                       # the table's bytes as read from the checkpoint

    def load(self, weight: torch.Tensor | QTensor, device: torch.device, dtype: torch.dtype) -> None:
        """Place the (plain or quantized) table on `device`; kinds without row access are decoded once."""
        if tuple(weight.shape) != (self.vocab_size, self.dim):
            raise ShapeError(f"model.embed_tokens.weight: shape {list(weight.shape)} != "
                             f"{[self.vocab_size, self.dim]}")
        if self.cut is not None:
            weight, _ = self.cut.weight(weight, "model.embed_tokens.weight")
        self.stored_bytes = weight.nbytes if isinstance(weight, QTensor) else weight.numel() * weight.element_size()
        if isinstance(weight, QTensor) and not hasattr(weight, "take_rows"):
            weight = weight.dequantize(dtype)   # kinds without row access: decode the table once
        if isinstance(weight, QTensor):
            self.table = weight.to(device)
        else:                                   # a plain table narrower than dtype stays so: rows widen exactly
            narrower = weight.is_floating_point() and weight.element_size() < torch.finfo(dtype).bits // 8
            self.table = weight.to(device) if narrower else weight.to(device, dtype)
        self.dtype = dtype

    def read_rows_from(self, state) -> None:
        """Look rows up in `state` (a tied lm_head's kernel state with take_rows and describe) from now on, in
        place of a table of its own: the tied table is held once, in the layout the lm_head computes from."""
        self.table = state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cut is None:
            return self._lookup(ids)
        inside = (ids >= self.cut.start) & (ids < self.cut.stop)
        out = self._lookup(torch.where(inside, ids - self.cut.start, 0))
        return out * inside.unsqueeze(-1).to(out.dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if hasattr(self.table, "take_rows"):          # a QTensor, or the lm_head state it shares (read_rows_from)
            return self.table.take_rows(ids.reshape(-1)).dequantize(self.dtype).reshape(*ids.shape, self.dim)
        return F.embedding(ids, self.table).to(self.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] for default, linear and llama3 RoPE (transformers' formulas),
    computed on the CPU whatever the default device (the model is built on `meta`)."""
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=cpu) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3" and "low_freq_factor" not in scaling and "freq_factors" in scaling:
        # GGUF rope_freqs: llama.cpp's exact per-frequency divisors
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float, device=cpu)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise UnsupportedError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 are)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF layout; GGUF loaders undo ggml's interleaved permutation). Its frequencies
    are not checkpoint tensors: they are made here, on `device`, when the model is built."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device: torch.device | str = "cpu",
                 triton: bool = False):
        super().__init__()
        self.triton = triton
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], tuple]:
        """The rotation of one step's tokens, made once for every layer: (q [T, Hq, D], k [T, Hk, D]) ->
        rotated (q, k). The Triton kernel computes the angles itself; the torch path computes cos / sin
        here, once per step instead of once per layer."""
        if self.triton:
            return TritonRope(positions, self.inv_freq)
        return TorchRope(*rotary.cos_sin(positions, self.inv_freq, dtype))


class TorchRope:
    """One step's rotation in torch: rope(q, k) -> rotated (q, k), from cos and sin [T, 1, D] made once for every
    layer (which the CPU's native rotate-and-store reads too)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.rotate(q, self.cos, self.sin), rotary.rotate(k, self.cos, self.sin)


class TritonRope:
    """One step's rotation on the Triton kernel: rope(q, k) -> rotated (q, k), or rotate_and_store, which
    writes the rotated k and v into the paged KV cache in the same launch (the attention context uses it)."""

    def __init__(self, positions: torch.Tensor, inv_freq: torch.Tensor):
        self.positions, self.inv_freq = positions, inv_freq

    def __call__(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.rotary(q, k, self.positions, self.inv_freq)

    def rotate_and_store(self, q, k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, fmt) -> torch.Tensor:
        """Rotated q; the rotated k and v stored at slot_mapping (see rotary.rotary_and_store)."""
        return rotary.rotary_and_store(q, k, v, self.positions, self.inv_freq, k_cache, v_cache, slot_mapping,
                                       k_scale, v_scale, fmt)
