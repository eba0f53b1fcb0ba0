"""GPTQ: second-order weight quantization (Frantar et al.; AutoGPTQ's `fasterquant`), onto an integer
grid into the `Affine` kind or onto the FP8 e4m3 grid into the `Fp8` kind.

    h = Hessian(in_features); h.add_batch(x [B, T, K] or [T, K]) ...     H = 2/n Σ x xᵀ (running mean)
    gptq_quantize(w [N, K], h, bits, group_size, symmetric, act_order, static_groups, damp, blocksize)
        -> (Affine, loss)
    gptq_fp8(w [N, K], h, strategy="channel"|"tensor", act_order, damp, blocksize) -> (Fp8, loss)

Both run one loop (_gptq, the reference's step for step); only the `Grid` differs.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from quanta.quant.errors import ConfigError
from quanta.quant.fp8_quant import STRATEGIES, amax_scale, fp8_cast
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.fp8 import Fp8
from quanta.quant.rtn import check_scheme, gptq_params, quantize_codes


class Hessian:
    """The running GPTQ Hessian H = 2/n Σ x xᵀ of one linear's inputs (n counts sequences, as GPTQ does)."""

    def __init__(self, columns: int, device: torch.device | str = "cpu"):
        self.H = torch.zeros(columns, columns, dtype=torch.float32, device=device)
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


class IntGrid(NamedTuple):
    """GPTQ's integer grid: params (scale [R], zero [R]) of rows by `find_params`, codes 0 .. 2^b - 1."""
    bits: int
    symmetric: bool

    def params(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return gptq_params(x, self.bits, self.symmetric)

    def code(self, c: torch.Tensor, p: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return quantize_codes(c, p[0], p[1], self.bits)

    def value(self, code: torch.Tensor, p: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return p[0] * (code - p[1])


class Fp8Grid(NamedTuple):
    """The e4m3 grid: params (scale [R],) = amax / 448 per row (channel) or over all rows (tensor).

    One group per row (channel) or one for the weight (tensor): its scale is found once on the weight as given,
    before any update, as llm-compressor's GPTQ takes it from the weight observer, and every column rounds as
    compressed-tensors does (clamp to ±448, cast to e4m3). With no off-diagonal Hessian terms the result is plain
    round-to-nearest FP8. Act-order costs nothing in the FP8 format: the scale does not depend on the column
    order."""
    strategy: str

    def params(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        amax = x.abs().amax(dim=1) if self.strategy == "channel" else x.abs().max().expand(x.shape[0])
        return (amax_scale(amax),)

    def code(self, c: torch.Tensor, p: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return fp8_cast(c, p[0]).float()        # an e4m3 value, exact in float32

    def value(self, code: torch.Tensor, p: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return code * p[0]


Grid = IntGrid | Fp8Grid      # all that differs between the two: a grid finds a group's parameters, rounds a column


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
    diag = torch.arange(H.shape[0], device=H.device)
    H[diag, diag] += damp * torch.mean(torch.diag(H))
    L, info = torch.linalg.cholesky_ex(H)
    if info != 0:
        raise ConfigError(f"{name}: GPTQ Hessian is not positive definite with damp={damp}; "
                          f"raise damp (e.g. 0.1) or use more calibration data")
    # cholesky_solve against I equals cholesky_inverse(L) and is far faster on CPU (blocked triangular solves)
    inverse = torch.cholesky_solve(torch.eye(H.shape[0], dtype=H.dtype, device=H.device), L)
    return torch.linalg.cholesky(inverse, upper=True)


class _Result(NamedTuple):
    codes: torch.Tensor           # [N, K] float, original column order
    params: list[tuple]           # one grid parameter tuple per group, in group order
    perm: torch.Tensor            # the column order quantized (arange(K) without act-order)
    loss: float


def _check(w: torch.Tensor, hessian: Hessian, damp: float, name: str) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ConfigError(f"{name}: GPTQ needs a 2-D float weight, got {w.dtype} {list(w.shape)}")
    if not 0 < damp < 1:
        raise ConfigError(f"{name}: GPTQ damp must be in (0, 1), got {damp!r}")
    if hessian.H.shape != (w.shape[1], w.shape[1]):
        raise ConfigError(f"{name}: Hessian is {list(hessian.H.shape)}, weight has in_features {w.shape[1]}")


def _gptq(w: torch.Tensor, hessian: Hessian, grid: Grid, group: int, act_order: bool, static_groups: bool,
          damp: float, blocksize: int, name: str) -> _Result:
    """The GPTQ loop of w [N, K] onto `grid` in groups of `group` columns.

    It follows the reference loop step for step so that results agree with it:
      * dead columns (diag(H) == 0): H[d, d] = 1 and W[:, d] = 0;
      * act-order (desc_act): columns permuted by diag(H) descending; groups are consecutive in the
        permuted order, so the Affine carries `g_idx` in the ORIGINAL column order (as GPTQ checkpoints
        store it) and codes in the original order;
      * static groups: group parameters found once on the unpermuted, unupdated weight (then g_idx is the
        plain k // group_size and is left out);
      * dampening: H += damp * mean(diag(H)) * I, then the upper Cholesky factor of H⁻¹;
      * lazy batch updates over `blocksize` columns; group parameters are found on the working weight
        when a group starts (GPTQ `Quantizer.find_params`, see rtn.gptq_params).
    `loss` is the reference's sum of (w - q)² / d² / 2 over all weights, divided by nsamples."""
    n, k = w.shape
    grouped = group < k
    W = w.detach().float().clone()
    params = grid.params(W)              # the whole-row parameters (per-channel case), as the references
    H = hessian.H.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    static = []
    if grouped and static_groups:
        static = [grid.params(W[:, i:i + group]) for i in range(0, k, group)]
    perm = torch.arange(k, device=W.device)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = _inverse_factor(H, damp, name)

    # The loop works on Wᵀ so that a column is a contiguous row; its per-column steps are small,
    # latency-bound ops that run on one thread (a second thread only adds synchronization waits).
    WT = W.t().contiguous()
    codes = torch.zeros_like(WT)
    losses = torch.zeros_like(WT)
    found = []
    with one_thread():
        for i1 in range(0, k, blocksize):
            i2 = min(i1 + blocksize, k)
            W1 = WT[i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                col = i1 + i
                if grouped and static_groups:
                    params = static[int(perm[col]) // group]
                elif grouped and col % group == 0:
                    # the reference reads the lazily-updated W here, not the in-block W1
                    params = grid.params(WT[col:col + group].t())
                    found.append(params)
                c = W1[i]
                d = Hinv1[i, i]
                code = grid.code(c, params)
                q = grid.value(code, params)
                codes[col] = code
                losses[col] = (c - q) ** 2 / d ** 2 / 2
                err = (c - q) / d
                W1[i:].addr_(Hinv1[i, i:], err, alpha=-1)
                Err1[i] = err
            if i2 < k:
                WT[i2:].addmm_(Hinv[i1:i2, i2:].t(), Err1, alpha=-1)
    codes = codes.t()
    if act_order:
        codes = codes[:, torch.argsort(perm)]
    if grouped and static_groups:
        found = static
    elif not grouped:
        found = [params]
    return _Result(codes, found, perm, float(losses.sum()) / max(hessian.nsamples, 1))


def gptq_quantize(w: torch.Tensor, hessian: Hessian, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                  act_order: bool = False, static_groups: bool = False, damp: float = 0.01, blocksize: int = 128,
                  name: str = "weight") -> tuple[Affine, float]:
    """GPTQ of w [N, K] onto the integer grid against `hessian`'s inputs: (Affine, average loss)."""
    _check(w, hessian, damp, name)
    group = check_scheme(name, tuple(w.shape), bits, group_size)
    r = _gptq(w, hessian, IntGrid(bits, symmetric), group, act_order, static_groups, damp, blocksize, name)
    g_idx = None
    if act_order and group < w.shape[1] and not static_groups:
        g_idx = (torch.argsort(r.perm) // group).to(torch.int32)
    scales = torch.stack([s for s, _ in r.params], dim=1)
    zeros = 2 ** (bits - 1) if symmetric else torch.stack([z for _, z in r.params], dim=1).to(torch.uint8)
    affine = Affine(codes=r.codes.to(torch.uint8), scales=scales, bits=bits, group_size=group, zeros=zeros,
                    g_idx=g_idx)
    return affine, r.loss


def gptq_fp8(w: torch.Tensor, hessian: Hessian, strategy: str = "channel", act_order: bool = False,
             damp: float = 0.01, blocksize: int = 128, name: str = "weight") -> tuple[Fp8, float]:
    """GPTQ of w [N, K] onto the e4m3 grid (dynamic activations) against `hessian`'s inputs: (Fp8, average loss)."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"{name}: FP8 weight strategy must be one of {STRATEGIES}, got {strategy!r}")
    _check(w, hessian, damp, name)
    r = _gptq(w, hessian, Fp8Grid(strategy), w.shape[1], act_order, False, damp, blocksize, name)
    scale = r.params[0][0]
    return Fp8(data=r.codes.to(torch.float8_e4m3fn), scale=scale if strategy == "channel" else scale[0]), r.loss
