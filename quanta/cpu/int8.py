"""Symmetric 8-bit weights on the CPU through torch's `_weight_int8pack_mm` (W = q_signed * scale): bnb LLM.int8
and channel-wise W8A16 checkpoints, and grouped ones (GGUF Q8_0's blocks of 32, GPTQ 8-bit), stay 8-bit in memory.

torch's kernel takes one scale per output row. A weight with groups along K is held as its groups' columns side by
side, codes [groups, N, group] (the same bytes as the codes) with scales [groups, N], and computed as one call per
group summed in float32 in group order: every row's sum runs in the same order whatever the batch. The kernel is
fast only at bfloat16 input (its float32 path is a reference loop), so activations and scales are rounded to it, as
cpu_int4's are. The scales are held once, exactly (GGUF Q8_0's fp16: the file's bytes), and rounded to bfloat16 a
group at a call; `exact_rows` gives float32 rows of the weight itself, for recomputing the few logits that can be a
row's largest (cpu_matmul.refine_top).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from quanta.cpu import affine as cpu_affine
from quanta.cpu.affine import reference  # noqa: F401  (the oracle)
from quanta.quant.qtensor import QTensor

NAME = "cpu_int8"
# bfloat16 roundings a product's terms carry, for cpu_matmul.refine_top_rows: the activation's, the scale's, the
# group sum's, and one more for the float32 sums inside and across groups
ROUNDINGS = 4


@dataclass
class State:
    codes: torch.Tensor     # int8 [groups, N, group]: group g's columns of every row
    exact_scales: torch.Tensor  # [groups, N] float16 where that holds them exactly (GGUF's, GPTQ's), else float32

    dtype = torch.bfloat16  # what the products run in
    roundings = ROUNDINGS

    def exact_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` of the weight [len, K] in float32, exactly."""
        codes = self.codes[:, rows].float() * self.exact_scales[:, rows, None].float()
        return codes.permute(1, 0, 2).reshape(len(rows), -1)

    def exact_products(self, rows: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """sum_k W[rows[i], k] x[i, k] in float32 for x [len, K] (float32), over whole contiguous rows as
        cpu_matmul.refine_top sums a plain weight's: the order of a row's sum does not depend on `len`."""
        return (self.exact_rows(rows) * x).sum(-1)

    def row_norms(self) -> torch.Tensor:
        """The 2-norm of each row [N], in float32, a group of columns at a time (no float copy of the weight)."""
        sums = torch.zeros(self.codes.shape[1])
        for codes, scales in zip(self.codes, self.exact_scales):
            sums += codes.float().pow(2).sum(-1) * scales.float().pow(2)
        return sums.sqrt()


def supports(weight, device: torch.device, dtype: torch.dtype) -> str | None:
    scheme, why_not = cpu_affine.cpu_scheme(weight, device, dtype)
    if why_not is not None:
        return why_not
    if scheme.bits != 8 or scheme.act_order or scheme.zero != "sym" or cpu_affine.affine_form(weight).zeros != 128:
        return f"needs symmetric 8-bit, weight is {weight.describe()}"
    if scheme.num_groups * scheme.group_size != weight.shape[1]:
        return f"groups of {scheme.group_size} do not tile K={weight.shape[1]}"
    return None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the GEMM's arithmetic runs in for activations of `dtype`: bfloat16 (torch's float32 path is a
    reference loop)."""
    return torch.bfloat16


def prepare(weight: QTensor, device: torch.device, dtype: torch.dtype) -> State:
    a = cpu_affine.affine_form(weight)
    n, k = a.shape
    groups = a.num_groups
    codes = (a.codes.to(torch.int16) - 128).to(torch.int8).view(n, groups, k // groups)
    scales = a.effective_scales().float().T.contiguous()
    exact = scales.half() if torch.equal(scales.half().float(), scales) else scales
    return State(codes.permute(1, 0, 2).contiguous(), exact)


def apply(x: torch.Tensor, state: State, bias: torch.Tensor | None = None) -> torch.Tensor:
    groups, n, width = state.codes.shape
    rows = x.reshape(-1, groups, width).to(torch.bfloat16)
    y = torch.zeros(rows.shape[0], n)
    for g in range(groups):
        scales = state.exact_scales[g].to(torch.bfloat16)
        y += torch.ops.aten._weight_int8pack_mm(rows[:, g].contiguous(), state.codes[g], scales)
    return cpu_affine.finish(y, x.shape[:-1], n, x.dtype, bias)


def path(state: State, m: int) -> tuple[str, str]:
    """(NAME, why) at any M."""
    name, why = cpu_affine.path(NAME, 8)
    groups = state.codes.shape[0]
    return name, why if groups == 1 else f"{why}, one call per group of {state.codes.shape[2]} columns ({groups})"
