"""The engine's adapter slots: `max_loras` adapters resident at once, each linear layer holding every slot's
A and B stacked (LayerSlots), one step's token-to-slot map shared by all layers (LoRAStep), and the manager
that loads adapters into slots, evicting the least recently used one no running step needs (LoRASlots).

A running batch never needs more than max_loras adapters (the scheduler's rule), so an adapter it needs always
finds a slot. Read adapters stay on the host, up to max_cpu_loras of them, so one evicted from its slot comes
back without reading its file again. On the CPU a step's tokens are grouped by slot and multiplied with the
adapter's own-rank matrices through the batch-invariant matmul; elsewhere the Triton kernels take tiles of
one slot's rows, grouped on the host.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from quanta.lora import kernels as lora_kernel
from quanta.cpu import matmul as cpu_matmul
from quanta.kernels.lora_epilogue import LoRAEpilogue
from quanta.lora.adapter import Adapter, load_adapter
from quanta.lora.request import LoRARequest
from quanta.quant.errors import ConfigError

NO_SLOT = -1
TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
NORM_BEFORE = {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "post_attention_layernorm"}


class LoRAStep:
    """One step's map from token rows to slots, read by every layer. Under `triton`: `slots` (int32 [T]) and
    the rows grouped by slot, `order` and `starts` (quanta.lora.kernels.sort_by_slot), views at fixed places of
    one device buffer, so CUDA graphs read them in place. On the CPU: `groups` ((slot, rows), rows a slice or an
    index tensor). `active`: whether any token has an adapter, or a graph is being captured (a captured graph
    must launch the kernels whatever the steps it replays hold)."""

    def __init__(self, capacity: int, n_slots: int, device: torch.device, triton: bool):
        self.capacity, self.n_slots, self.triton = capacity, n_slots, triton
        self.buffer = torch.full((2 * capacity + n_slots + 1,), NO_SLOT, dtype=torch.int32, device=device)
        self.starts = self.buffer[2 * capacity:]
        self.starts.zero_()
        self.slots, self.order = self.buffer[:0], self.buffer[capacity:capacity]
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.active = False

    def set(self, runs: list[tuple[int, int]], capture: bool = False) -> None:
        """The step's token rows as runs of (slot, rows) in row order (NO_SLOT for none); `capture`: a CUDA
        graph is about to be captured over them."""
        per_row = np.repeat(np.array([s for s, _ in runs], dtype=np.int32), [n for _, n in runs])
        n, cap = per_row.size, self.capacity
        self.slots, self.order = self.buffer[:n], self.buffer[cap:cap + n]
        self.groups = []
        self.active = capture or bool((per_row >= 0).any())
        if self.triton:                          # the kernels read the slots themselves
            key = np.where(per_row < 0, self.n_slots, per_row)
            starts = np.zeros(self.n_slots + 1, dtype=np.int32)
            starts[1:] = np.cumsum(np.bincount(key, minlength=self.n_slots + 1))[:-1]
            if n:
                self.slots.copy_(torch.from_numpy(per_row), non_blocking=True)
                self.order.copy_(torch.from_numpy(np.argsort(key, kind="stable").astype(np.int32)),
                                 non_blocking=True)
            self.starts.copy_(torch.from_numpy(starts), non_blocking=True)
            return
        rows_of = torch.from_numpy(per_row)
        for slot in sorted({s for s, _ in runs} - {NO_SLOT}):
            rows = torch.nonzero(rows_of == slot)[:, 0]
            one_run = int(rows[-1] - rows[0]) + 1 == rows.numel()
            self.groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1) if one_run else rows))


class LayerSlots:
    """Every slot's adapter for one linear layer of `parts` (checkpoint module names, their output sizes): the
    stacked A [S, P*R, K] and B [S, N, R] and scales [S, P] the kernels gather from, and per slot the parts'
    own-rank (A, B, scaling) for the CPU path. `input_order`: the feature order in which the layer's input
    arrives (act-order kernels), applied to A's columns."""

    def __init__(self, parts: list[str], sizes: list[int], in_features: int, max_loras: int, rank: int,
                 device: torch.device, dtype: torch.dtype, stacked: bool, input_order: torch.Tensor | None):
        self.parts, self.in_features = parts, in_features
        self.bounds = [0]
        for n in sizes:
            self.bounds.append(self.bounds[-1] + n)
        self.rank, self.input_order = rank, None if input_order is None else input_order.long().cpu()
        self.own: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * max_loras   # CPU path
        self.stacked = stacked
        if stacked:
            p = len(parts)
            self.a = torch.zeros(max_loras, p * rank, in_features, device=device, dtype=dtype)
            self.b = torch.zeros(max_loras, self.bounds[-1], rank, device=device, dtype=dtype)
            self.scale = torch.zeros(max_loras, p, device=device, dtype=torch.float32)
        self.device, self.dtype = device, dtype

    def nbytes(self) -> int:
        """Device bytes of the stacked slots (the CPU path's own-rank copies are the adapters' size)."""
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.scale)) if self.stacked else 0

    def fill(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter`'s matrices for this layer's parts in `slot` (zeros for parts it does not adapt)."""
        own = []
        for p, name in enumerate(self.parts):
            w = adapter.weights.get(name)
            if w is None:
                own.append(None)
                continue
            a = w.a if self.input_order is None else w.a[:, self.input_order]
            own.append((a.to(self.device, self.dtype), w.b.to(self.device, self.dtype), float(w.scaling)))
        if not self.stacked:
            self.own[slot] = self._joined(own) if any(o is not None for o in own) else None
            return
        r = self.rank
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scale[slot].zero_()
        for p, part in enumerate(own):
            if part is not None:
                a, b, scaling = part
                rank = a.shape[0]
                self.a[slot, p * r:p * r + rank] = a
                self.b[slot, self.bounds[p]:self.bounds[p + 1], :rank] = b
                self.scale[slot, p] = scaling
        self.own[slot] = None                   # the kernels read the stacked copy only

    def _joined(self, own: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The parts' own-rank pairs as one product for the CPU path: A stacked [sum of ranks, K], B block-diagonal
        [N, sum of ranks] (each part's rows read its own rank columns only) and each output column's scaling [N]
        (0 for a part the adapter leaves alone), so a merged layer costs two matmuls, not two a part."""
        ranks = [0 if part is None else part[0].shape[0] for part in own]
        a = torch.zeros(sum(ranks), self.in_features, device=self.device, dtype=self.dtype)
        b = torch.zeros(self.bounds[-1], sum(ranks), device=self.device, dtype=self.dtype)
        scaling = torch.zeros(self.bounds[-1], device=self.device, dtype=torch.float32)
        at = 0
        for p, part in enumerate(own):
            if part is not None:
                lo, hi, r = self.bounds[p], self.bounds[p + 1], ranks[p]
                a[at:at + r], b[lo:hi, at:at + r] = part[0], part[1]
                scaling[lo:hi] = part[2]
                at += r
        return a, b, scaling

    def epilogue(self, x: torch.Tensor, step: LoRAStep) -> LoRAEpilogue:
        """The products for x [T, K] (a GEMV's rows) left for the GEMV's epilogue to finish: the shrink runs
        now (quanta.kernels.lora_epilogue)."""
        return lora_kernel.shrink_rows(x if x.stride(-1) == 1 else x.contiguous(), step.slots, self.a, self.b,
                                       self.scale, self.bounds)

    def norm_shrink(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    step: LoRAStep):
        """The norm of x (and residual) that feeds this layer, and the products' epilogue, from one launch
        (quanta.lora.kernels.norm_shrink): (y or (y, h), LoRAEpilogue)."""
        return lora_kernel.norm_shrink(x, weight, eps, residual, step.slots, self.a, self.b, self.scale,
                                       self.bounds)

    def add(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """y (this layer's base output for input x) plus each token's adapter products, in place."""
        if step.triton:
            return lora_kernel.add_lora(x, y, step.slots, self.a, self.b, self.scale, self.bounds, step.order,
                                        step.starts)
        for slot, rows in step.groups:
            own = self.own[slot]
            if own is None:
                continue
            a, b, scaling = own
            y[rows] += (cpu_matmul.linear(cpu_matmul.linear(x[rows], a), b) * scaling).to(y.dtype)
        return y


class LoRASlots:
    """`max_loras` resident adapters over `model`'s layers (TARGETS of every decoder layer), loaded on demand:
    activate() before a step, then the layers read `step`. `max_cpu_loras`: adapters kept read on the host."""

    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int, capacity: int,
                 triton: bool):
        norm = model.model.norm.weight
        device, dtype = norm.device, norm.dtype
        self.config = model.config
        self.max_loras, self.max_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        rank = 1 << max(0, max_lora_rank - 1).bit_length()           # the kernels' rank tile: a power of two
        self.step = LoRAStep(capacity, max_loras, device, triton)
        self.layers: list[LayerSlots] = []
        for i, layer in enumerate(model.model.layers):
            for target in TARGETS:
                module = layer.get_submodule(target)
                prefix = f"model.layers.{i}.{target.rsplit('.', 1)[0]}"
                parts = list(module.parts.items()) if hasattr(module, "parts") else \
                    [(target.rsplit(".", 1)[1], module.out_features)]
                slots = LayerSlots([f"{prefix}.{name}" for name, _ in parts], [n for _, n in parts],
                                   module.in_features, max_loras, rank, device, dtype, stacked=triton,
                                   input_order=getattr(module, "input_order", None))
                module.attach_lora(slots, self.step)
                if triton and target in NORM_BEFORE:        # the norm before it may make its shrink too
                    getattr(layer, NORM_BEFORE[target]).feed_lora(module)
                self.layers.append(slots)
        self.resident: OrderedDict[int, int] = OrderedDict()        # adapter id -> slot, least recent first
        self.read: OrderedDict[int, Adapter] = OrderedDict()        # adapter id -> adapter read, on the host
        self.names: dict[int, str] = {}

    def nbytes(self) -> int:
        """Device bytes the slots hold."""
        return sum(layer.nbytes() for layer in self.layers)

    def check(self, request: LoRARequest) -> Adapter:
        """Read the request's adapter (once; kept on the host) and check it fits this model and max_lora_rank;
        a typed error names the problem before the request is queued."""
        adapter = self.read.get(request.lora_int_id)
        known = self.names.get(request.lora_int_id)
        if known is not None and known != request.lora_name:
            raise ConfigError(f"LoRA id {request.lora_int_id} is already {known!r}, not {request.lora_name!r}")
        if adapter is None:
            adapter = load_adapter(request.lora_path, self.config)
            if adapter.rank > self.max_rank:
                raise ConfigError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}) has rank "
                                  f"{adapter.rank}, more than max_lora_rank={self.max_rank}")
            self.read[request.lora_int_id] = adapter
            self.names[request.lora_int_id] = request.lora_name
        self.read.move_to_end(request.lora_int_id)
        spare = [i for i in self.read if i not in self.resident and i != request.lora_int_id]
        for evicted in spare[:max(0, len(self.read) - self.max_cpu_loras)]:
            del self.read[evicted]          # read again from its file when next asked for
        return adapter

    def activate(self, requests: list[LoRARequest | None]) -> list[int]:
        """The slot of each request's adapter (NO_SLOT for none), loading the adapters not resident into the
        slots of those least recently used that this step does not need."""
        needed = {r.lora_int_id for r in requests if r is not None}
        if len(needed) > self.max_loras:
            raise ConfigError(f"a step needs {len(needed)} adapters, more than max_loras={self.max_loras}")
        out = []
        for request in requests:
            if request is None:
                out.append(NO_SLOT)
                continue
            rid = request.lora_int_id
            if rid not in self.resident:
                self._load(request, needed)
            self.resident.move_to_end(rid)
            out.append(self.resident[rid])
        return out

    def _load(self, request: LoRARequest, needed: set[int]) -> None:
        adapter = self.check(request)
        if len(self.resident) < self.max_loras:
            slot = len(self.resident)
        else:
            victim = next(i for i in self.resident if i not in needed)
            slot = self.resident.pop(victim)
        for layer in self.layers:
            layer.fill(slot, adapter)
        self.resident[request.lora_int_id] = slot

    def set_step(self, runs: list[tuple[LoRARequest | None, int]], capture: bool = False) -> None:
        """Activate the adapters of a step whose token rows come as (request, rows) pairs, one per sequence
        in row order, and map the rows to slots; `capture`: a CUDA graph is captured over this step."""
        slots = self.activate([request for request, _ in runs])
        self.step.set([(slot, n) for slot, (_, n) in zip(slots, runs)], capture)
