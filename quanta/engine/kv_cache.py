"""The paged KV cache: per layer K and V tensors [num_blocks, block_size, Hk, D], in the model dtype
or as fp8 (e4m3 / e5m2) codes in uint8 with per-kv-head float32 scales, and how many blocks fit.

FP8 scales, in order of preference:
  1. the checkpoint's `model.layers.{i}.self_attn.k_scale` / `v_scale` (scalar: per tensor, or [Hk]: per
     head), as llm-compressor / vLLM write them;
  2. e4m3 without checkpoint scales: per tensor, from the first real prefill of each layer,
     k_scale = amax|k| / 200 and v_scale = amax|v| / 100 (vLLM's calculate_kv_scales constants: 2.2x
     and 4.5x head-room below 448 for later tokens; larger values saturate);
  3. e5m2 without checkpoint scales: 1.0 (its range, +-57344, needs none).
"""
from __future__ import annotations

import logging

import torch

from quanta.kernels import paged_kv
from quanta.kernels.paged_kv import KvFormat
from quanta.quant.errors import ShapeError

log = logging.getLogger(__name__)

CALIBRATION_DIVISOR = {"k": 200.0, "v": 100.0}


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype, kv: KvFormat) -> int:
    """Bytes of one KV block over all layers (K and V), in the cache's storage dtype."""
    return block_size * kv.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype.itemsize)


def checkpoint_kv_scales(tensors: dict, num_layers: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`...self_attn.{k,v}_scale` tensors (popped from `tensors`) -> (k_scale, v_scale) [L, Hk] float32, or None."""
    names = [n for n in tensors if n.endswith(("self_attn.k_scale", "self_attn.v_scale"))]
    if not names:
        return None
    scales = {"k": torch.ones(num_layers, num_kv_heads), "v": torch.ones(num_layers, num_kv_heads)}
    for name in names:
        value = torch.as_tensor(tensors.pop(name)).float().flatten().cpu()
        layer, which = int(name.split(".")[2]), name[-7]
        if value.numel() not in (1, num_kv_heads) or not 0 <= layer < num_layers:
            raise ShapeError(f"{name}: a kv scale must hold 1 or {num_kv_heads} values, got {value.numel()}")
        scales[which][layer] = value
    return scales["k"], scales["v"]


class PagedKVCache:
    """The cache's tensors and how they are written and read: `triton` says whether the KV store and
    paged attention run as Triton kernels or as their torch references (the model's elementwise ops
    follow the same decision, made once by the engine)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, kv: KvFormat | str = "auto",
                 scales: tuple[torch.Tensor, torch.Tensor] | None = None, triton: bool = False):
        self.fmt = KvFormat.parse(kv).fp8
        self.num_blocks, self.block_size = num_blocks, block_size
        store = torch.uint8 if self.fmt is not None else dtype
        self.kv = torch.empty(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=store, device=device)
        self._layers = [(self.kv[0, i], self.kv[1, i]) for i in range(num_layers)]   # views made once, not per call
        self.k_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
        self.v_scale = torch.ones_like(self.k_scale)
        if scales is not None:
            self.k_scale.copy_(scales[0]), self.v_scale.copy_(scales[1])
        # Scales still to be computed from the first real prefill (rule 2 above); only claim_calibration clears it.
        self._uncalibrated = self.fmt is not None and self.fmt.name == "fp8_e4m3" and scales is None
        self.triton = triton

    @property
    def needs_calibration(self) -> bool:
        """Whether the fp8 scales still wait for a prefill to compute them from (rule 2)."""
        return self._uncalibrated

    def claim_calibration(self) -> bool:
        """True for exactly one step, the first that asks while the scales wait for it: that step's
        prefill computes them (ForwardBatch.calibrate) as it stores its K/V."""
        claimed, self._uncalibrated = self._uncalibrated, False
        return claimed

    @property
    def nbytes(self) -> int:
        """Bytes the K and V tensors take."""
        return self.kv.numel() * self.kv.element_size()

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (K, V) caches of one layer, [num_blocks, block_size, Hk, D] each."""
        return self._layers[layer]

    def calibrate(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rule 2: per-tensor scales from this batch's k, v (no host sync)."""
        for scale, x, which in ((self.k_scale, k, "k"), (self.v_scale, v, "v")):
            value = (x.detach().abs().amax().float() / CALIBRATION_DIVISOR[which]).clamp_min(1e-8)
            scale[layer].copy_(value.expand(scale.shape[1]))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              calibrate: bool = False) -> None:
        """Store the step's k, v [T, Hk, D] at slot_mapping [T] (slots < 0 are skipped)."""
        if calibrate:
            self.calibrate(layer, k, v)
        k_cache, v_cache = self.layer(layer)
        store = paged_kv.store if self.triton else paged_kv.reference_store
        store(k, v, k_cache, v_cache, slot_mapping, self.k_scale[layer], self.v_scale[layer], self.fmt)
