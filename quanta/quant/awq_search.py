"""AWQ: activation-aware per-input-channel scales and weight clipping (AutoAWQ's `AwqQuantizer` search).

    s = search_scale(x [T, K], linears, forward, bits, group_size)    per-channel scales [K]
    fold_scale_into_norm(norm_weight, linears, s) / fold_scale_into_linear(prev_linear, linears, s)
    max_val = search_clip(w [N, K], x [T, K], bits, group_size)      [N, K/group] clip bounds
    clip_weight(w, max_val)                                          w clamped to ±max_val per group

Q, below, is AutoAWQ's fake quantization (rtn, "awq").
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from quanta.quant.rtn import fake_quantize


@torch.no_grad()
def search_scale(x: torch.Tensor, linears: list[torch.nn.Module], forward: Callable[[torch.Tensor], torch.Tensor],
                 bits: int, group_size: int, symmetric: bool = False, n_grid: int = 20,
                 duo_scaling: bool = True) -> torch.Tensor:
    """The best AWQ per-input-channel scales [K] for `linears` reading x.

    `linears` are torch.nn.Linear modules that read the same input x (q/k/v after input_layernorm,
    gate/up after post_attention_layernorm, o_proj after v_proj when their shapes match, down_proj after
    up_proj); `forward(x)` runs the smallest module containing them all (self_attn, mlp or the linear
    itself) and returns its output. The search temporarily replaces the linears' weights by
    Q(W·s)/s for 20 ratios r in [0, 1):
        s = clamp(x_mean^r / (w_mean^(1-r) + 1e-4), 1e-4)   (duo scaling, AutoAWQ's default)
        s = clamp(x_mean^r, 1e-4)                          (without)
        s = s / sqrt(max(s) · min(s))
    and keeps the s whose output has the least mean squared error against the unquantized output."""
    weight = torch.cat([fc.weight for fc in linears], dim=0)
    group = group_size if group_size > 0 else weight.shape[1]
    w_abs = weight.abs().view(-1, group)
    w_mean = (w_abs / (w_abs.amax(dim=1, keepdim=True) + 1e-6)).view(weight.shape).mean(0)
    x_mean = x.abs().view(-1, x.shape[-1]).float().sum(dim=0).div(x.numel() // x.shape[-1]).to(x.dtype)
    reference = forward(x)
    originals = [fc.weight.data.clone() for fc in linears]
    best, best_err = None, float("inf")
    for step in range(n_grid):
        ratio = step / n_grid
        if duo_scaling:
            s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(ratio).clamp(min=1e-4).view(-1)
        s = s / (s.max() * s.min()).sqrt()
        s[torch.isinf(s) | torch.isnan(s)] = 1
        for fc, w in zip(linears, originals):
            fc.weight.data = fake_quantize(w * s.view(1, -1), bits, group, symmetric) / s.view(1, -1)
        err = (reference - forward(x)).float().pow(2).sum().item() / reference.numel()
        if err < best_err:
            best, best_err = s.clone(), err
    for fc, w in zip(linears, originals):
        fc.weight.data = w
    if best is None:
        raise FloatingPointError("AWQ scale search: every ratio gave a non-finite error")
    return best


@torch.no_grad()
def fold_scale_into_norm(norm_weight: torch.Tensor, linears: list[torch.nn.Module], s: torch.Tensor) -> None:
    """norm_weight /= s and every linear's input columns *= s, in place (RMSNorm · W stays equal): folding
    leaves the float model computing the same thing."""
    norm_weight.div_(s)
    for fc in linears:
        fc.weight.mul_(s.view(1, -1))


@torch.no_grad()
def fold_scale_into_linear(prev: torch.nn.Module, linears: list[torch.nn.Module], s: torch.Tensor) -> None:
    """prev's last len(s) output rows (and bias) /= s and the linears' input columns *= s, in place."""
    prev.weight[-s.numel():].div_(s.view(-1, 1))
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(s.view(-1))
    for fc in linears:
        fc.weight.mul_(s.view(1, -1))


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int, symmetric: bool = False,
                n_grid: int = 20, max_shrink: float = 0.5, n_sample_token: int = 512,
                row_batch: int = 64) -> torch.Tensor:
    """The best per-group clip bound max_val [N, K/group] of w [N, K] for inputs x [..., K]: each group's max |w|
    shrunk over 10 steps of 1/20, keeping the bound whose group output error (after Q) on a subsample of up to
    512 tokens is least."""
    n, k = w.shape
    group = group_size if group_size > 0 else k
    x = x.reshape(-1, k)
    x = x.reshape(1, x.shape[0], -1, group)
    x = x[:, ::max(1, x.shape[1] // n_sample_token)]
    w = w.reshape(n, 1, -1, group)
    out = []
    for r0 in range(0, n, row_batch):
        wb = w[r0:r0 + row_batch]
        org_max = wb.abs().amax(dim=-1, keepdim=True)
        best_max = org_max.clone()
        min_errs = torch.ones_like(org_max) * 1e9
        org_out = _group_out(x, wb)
        for i_s in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i_s / n_grid)
            q_w = fake_quantize(torch.clamp(wb, -max_val, max_val), bits, group, symmetric)
            err = (_group_out(x, q_w) - org_out).pow(2).mean(dim=1).view(min_errs.shape)
            better = err < min_errs
            min_errs[better] = err[better]
            best_max[better] = max_val[better]
        out.append(best_max)
    return torch.cat(out, dim=0).reshape(n, -1)


def _group_out(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_j x[0, t, g, j] · w[r, 0, g, j] -> [R, T, G]: AutoAWQ's (x * w).sum(-1) as one batched matmul
    over the groups, without the [R, T, G, group] product."""
    return torch.einsum("tgj,rgj->rtg", x[0], w[:, 0])


def clip_weight(w: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """w [N, K] with every group clamped to ±max_val [N, G] (AutoAWQ `apply_clip`)."""
    n, k = w.shape
    m = max_val.reshape(n, -1, 1)
    return torch.clamp(w.reshape(n, m.shape[1], -1), -m, m).reshape(n, k)
