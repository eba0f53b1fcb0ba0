"""GPTQ: second-order weight quantization into the `Affine` kind (Frantar et al.; AutoGPTQ's `fasterquant`).

    h = Hessian(in_features); h.add_batch(x [B, T, K] or [T, K]) ...     H = 2/n Σ x xᵀ (running mean)
    gptq_quantize(w [N, K], h, bits, group_size, symmetric, act_order, static_groups, damp, blocksize)
        -> (Affine, loss)

The algorithm follows the reference loop step for step so that results agree with it:
  * dead columns (diag(H) == 0): H[d, d] = 1 and W[:, d] = 0;
  * act-order (desc_act): columns permuted by diag(H) descending; groups are consecutive in the
    permuted order, so the Affine carries `g_idx` in the ORIGINAL column order (as GPTQ checkpoints
    store it) and codes in the original order;
  * static groups: group parameters found once on the unpermuted, unupdated weight (then g_idx is the
    plain k // group_size and is left out);
  * dampening: H += damp * mean(diag(H)) * I, then the upper Cholesky factor of H⁻¹;
  * lazy batch updates over `blocksize` columns; group parameters are found on the working weight
    when a group starts (GPTQ `Quantizer.find_params`, see rtn.gptq_params).
`loss` is the reference's sum of (w - q)² / d² / 2 over all weights, divided by nsamples.
"""
from __future__ import annotations

import contextlib

import torch

from quanta.quant.errors import ConfigError
from quanta.quant.kinds.affine import Affine
from quanta.quant.rtn import check_scheme, gptq_params, quantize_codes


class Hessian:
    """The running GPTQ Hessian H = 2/n Σ x xᵀ of one linear's inputs (n counts sequences, as GPTQ does)."""

    def __init__(self, columns: int):
        self.H = torch.zeros(columns, columns, dtype=torch.float32)
        self.nsamples = 0

    def add_batch(self, x: torch.Tensor) -> None:
        """Fold the inputs x [B, T, K] (or [T, K], one sequence) into the running mean."""
        if x.dim() == 2:
            x = x.unsqueeze(0)
        batch = x.shape[0]
        self.H *= self.nsamples / (self.nsamples + batch)
        self.nsamples += batch
        x = (2 / self.nsamples) ** 0.5 * x.reshape(-1, x.shape[-1]).float().t()
        self.H += x.matmul(x.t())


@contextlib.contextmanager
def one_thread():
    """Run the block with torch on one intra-op thread, restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _inverse_factor(H: torch.Tensor, damp: float, name: str) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp·mean(diag H)·I)⁻¹ (H is modified in place)."""
    diag = torch.arange(H.shape[0])
    H[diag, diag] += damp * torch.mean(torch.diag(H))
    L, info = torch.linalg.cholesky_ex(H)
    if info != 0:
        raise ConfigError(f"{name}: GPTQ Hessian is not positive definite with damp={damp}; "
                          f"raise damp (e.g. 0.1) or use more calibration data")
    # cholesky_solve against I equals cholesky_inverse(L) and is far faster on CPU (blocked triangular solves)
    inverse = torch.cholesky_solve(torch.eye(H.shape[0], dtype=H.dtype, device=H.device), L)
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(w: torch.Tensor, hessian: Hessian, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                  act_order: bool = False, static_groups: bool = False, damp: float = 0.01, blocksize: int = 128,
                  name: str = "weight") -> tuple[Affine, float]:
    """GPTQ of w [N, K] against `hessian`'s inputs: (Affine, average loss). See the module docstring."""
    n, k = w.shape
    group = check_scheme(name, (n, k), bits, group_size)
    grouped = group < k
    if not 0 < damp < 1:
        raise ConfigError(f"{name}: GPTQ damp must be in (0, 1), got {damp!r}")
    if hessian.H.shape != (k, k):
        raise ConfigError(f"{name}: Hessian is {list(hessian.H.shape)}, weight has in_features {k}")
    W = w.detach().float().clone()
    scale, zero = gptq_params(W, bits, symmetric)     # the whole-row parameters (per-channel case)
    H = hessian.H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    static = []
    if grouped and static_groups:
        static = [gptq_params(W[:, i:i + group], bits, symmetric) for i in range(0, k, group)]
    perm = torch.arange(k)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = _inverse_factor(H, damp, name)

    # The loop works on Wᵀ so that a column is a contiguous row; its per-column steps are small,
    # latency-bound ops that run on one thread (a second thread only adds synchronization waits).
    WT = W.t().contiguous()
    codes = torch.zeros_like(WT)
    losses = torch.zeros_like(WT)
    scales, zeros = [], []
    with one_thread():
        for i1 in range(0, k, blocksize):
            i2 = min(i1 + blocksize, k)
            W1 = WT[i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if grouped and static_groups:
                    scale, zero = static[int(perm[col]) // group]
                elif grouped and col % group == 0:
                    # the reference reads the lazily-updated W here, not the in-block W1
                    scale, zero = gptq_params(WT[col:col + group].t(), bits, symmetric)
                    scales.append(scale)
                    zeros.append(zero)
                c = W1[i]
                d = Hinv1[i, i]
                q_int = quantize_codes(c, scale, zero, bits)
                q = scale * (q_int - zero)
                codes[col] = q_int
                losses[col] = (c - q) ** 2 / d ** 2 / 2
                err = (c - q) / d
                W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
                Err1[i] = err
            if i2 < k:
                WT[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1)
    codes = codes.t()

    if grouped and static_groups:
        scales, zeros = [s for s, _ in static], [z for _, z in static]
    elif not grouped:
        scales, zeros = [scale], [zero]
    g_idx = None
    if act_order:
        invperm = torch.argsort(perm)
        codes = codes[:, invperm]
        if grouped and not static_groups:
            g_idx = (invperm // group).to(torch.int32)
    scale_t = torch.stack(scales, dim=1)
    zero_t = 2 ** (bits - 1) if symmetric else torch.stack(zeros, dim=1).to(torch.uint8)
    affine = Affine(codes=codes.to(torch.uint8), scales=scale_t, bits=bits, group_size=group, zeros=zero_t,
                    g_idx=g_idx)
    return affine, float(losses.sum()) / max(hessian.nsamples, 1)
