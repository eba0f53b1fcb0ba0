"""ggml's scale searches (ggml-quants.c make_qx_quants, make_q3_quants, make_qkx2/3_quants,
make_qp_quants), vectorized over groups in torch.

Each function takes float32 groups x [G, n] (and weights [G, n]) and returns per-group scales and
integer levels L [G, n], as the C function does for one group. To give the C results bit for bit,
every float operation is done in float32 in the C expression's order, and every sum runs element by
element (`seq_sum`) as the C loops do, never as a pairwise reduction. Rounding is ggml's
`nearest_int` (round half to even, which torch.round is).
"""
from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = 1e-15


def trial_scale(base: float, step: float, i: int, nmax: int) -> float:
    """The C constant `base + step*i + nmax` (base, step float literals, i and nmax int) in float32 steps."""
    f = np.float32
    return float(f(f(base) + f(step) * f(i)) + f(nmax))


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml nearest_int: round half to even, as int32."""
    return torch.round(v).to(torch.int32)


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in index order, one float32 add at a time (the C loop's rounding)."""
    cols = t.movedim(-1, 0).contiguous()      # each add then reads one contiguous column
    acc = cols[0].clone()
    for col in cols[1:]:
        acc += col
    return acc


def sqrtf(t: torch.Tensor) -> torch.Tensor:
    """C's sqrtf: the correctly rounded float32 square root. torch's vectorized float32 sqrt on the CPU is not
    correctly rounded (it misses on a fraction of a percent of inputs, which moves a K-quant's sub-block scale by
    a step); the float64 root rounded to float32 is exact, since float64 holds more than 2 x 24 + 2 bits."""
    return torch.sqrt(t.double()).to(t.dtype)


def rdiv(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t rounded once, as C does (torch computes `c / tensor` as c * (1 / tensor): two roundings)."""
    return torch.full_like(t, c) / t


def _first_absmax(x: torch.Tensor) -> torch.Tensor:
    """The signed value of the first element of largest |x| per group (C: `if (ax > amax)`)."""
    return x.gather(1, x.abs().argmax(1, keepdim=True)).squeeze(1)


def _safe(d: torch.Tensor) -> torch.Tensor:
    """d with zeros replaced by 1, for divisions whose result the caller masks out."""
    return torch.where(d == 0, torch.ones_like(d), d)


def make_qx_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants with rmse_type 1: symmetric levels L in [0, 2*nmax) (value (L - nmax) * scale)
    chosen by weighted least squares over 19 trial scales; weights qw, or x*x."""
    mx = _first_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = _safe(torch.where(zero, torch.zeros_like(mx), mx)).unsqueeze(1)
    w = x * x if qw is None else qw
    wx = w * x

    def trial(iscale):
        l = nearest_int(iscale * x).clamp(-nmax, nmax - 1).float()
        return l, seq_sum(wx * l), seq_sum(w * l * l)

    l, sumlx, suml2 = trial(rdiv(-float(nmax), mx))
    L = l
    scale = torch.where(suml2 != 0, sumlx / _safe(suml2), torch.zeros_like(suml2))
    best = scale * sumlx
    for i in range(-9, 10):
        if i == 0:
            continue
        l, sumlx, suml2 = trial(rdiv(-trial_scale(0.0, 0.1, i, nmax), mx))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        L = torch.where(better.unsqueeze(1), l, L)
        scale = torch.where(better, sumlx / _safe(suml2), scale)
        best = torch.where(better, scale * sumlx, best)
    L = torch.where(zero.unsqueeze(1), 0, L.to(torch.int32) + nmax)
    return torch.where(zero, 0.0, scale), L


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants with do_rmse: levels by x*x-weighted least squares, refined one element at a
    time (up to five passes) as the C loop does; L in [0, 2*nmax)."""
    mx = _first_absmax(x)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = _safe(torch.where(zero, torch.zeros_like(mx), mx)).unsqueeze(1)
    w = x * x
    wx = w * x
    L = nearest_int(rdiv(-float(nmax), mx) * x).clamp(-nmax, nmax - 1).float()
    sumlx, suml2 = seq_sum(wx * L), seq_sum(w * L * L)
    for _ in range(5):          # a pass that changes nothing leaves the next one nothing to change
        for i in range(x.shape[1]):
            xi, wi, wxi, li = x[:, i], w[:, i], wx[:, i], L[:, i]
            slx = sumlx - wxi * li
            sl2 = suml2 - wi * li * li
            ok = slx > 0
            new = nearest_int(xi * sl2 / torch.where(ok, slx, 1.0)).clamp(-nmax, nmax - 1).float()
            slx = slx + wxi * new
            sl2 = sl2 + wi * new * new
            take = ok & (new != li) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[:, i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(suml2 > 0, sumlx / _safe(suml2), 0.0)
    L = torch.where(zero.unsqueeze(1), 0, L.to(torch.int32) + nmax)
    return torch.where(zero, 0.0, scale), L


def make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants / make_qkx3_quants (the same search): asymmetric levels L in [0, nmax] with
    value L * scale - the_min, the (scale, min) pair fitted by weighted least squares over nstep+1
    trial scales. Returns (scale, L, the_min)."""
    mn = x.min(1).values.clamp(max=0.0)
    mx = x.max(1).values
    flat = mx == mn
    sum_w, sum_x = seq_sum(w), seq_sum(w * x)
    rng = _safe(torch.where(flat, torch.zeros_like(mx), mx - mn)).unsqueeze(1)
    xm = x - mn.unsqueeze(1)

    def err(scale, m, l):
        diff = scale.unsqueeze(1) * l + m.unsqueeze(1) - x
        return seq_sum(w * (diff.abs() if use_mad else diff * diff))

    iscale = rdiv(float(nmax), rng)
    L = nearest_int(iscale * xm).clamp(0, nmax).float()
    scale = (1 / iscale).squeeze(1)
    best, mn_best = err(scale, mn, L), mn
    for i in range(nstep + 1):
        # the C loop reads `min` after each improvement: later trials start from the best min so far
        cur = mn_best.unsqueeze(1)
        l = nearest_int(rdiv(trial_scale(rmin, rdelta, i, nmax), _safe(mx.unsqueeze(1) - cur)) * (x - cur))
        l = l.clamp(0, nmax).float()
        wl = w * l
        sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * l), seq_sum(wl * x)
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / _safe(D)
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / _safe(D)
        pos = this_min > 0
        this_min = torch.where(pos, 0.0, this_min)
        this_scale = torch.where(pos, sum_xl / _safe(sum_l2), this_scale)
        cur_err = err(this_scale, this_min, l)
        better = (D > 0) & (cur_err < best)
        L = torch.where(better.unsqueeze(1), l, L)
        best = torch.where(better, cur_err, best)
        scale = torch.where(better, this_scale, scale)
        mn_best = torch.where(better, this_min, mn_best)
    L = torch.where(flat.unsqueeze(1), 0, L.to(torch.int32))
    return torch.where(flat, 0.0, scale), L, torch.where(flat, -mn, -mn_best)


def make_qp_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants: levels L in [0, nmax] (value L * scale) for non-negative x (the sub-block
    scales of the imatrix K-quants), weighted by qw, refined element by element."""
    mx = x.max(1).values.clamp(min=0.0)
    zero = mx < GROUP_MAX_EPS
    mx = _safe(torch.where(zero, torch.zeros_like(mx), mx)).unsqueeze(1)

    def mse(l, scale):
        diff = x - scale * l
        return seq_sum(qw * diff * diff)

    iscale = rdiv(float(nmax), mx)
    best = mse(nearest_int(iscale * x).float(), 1 / iscale)
    for i in range(-4, 5):
        if i == 0:
            continue
        iscale_i = rdiv(trial_scale(0.0, 0.1, i, nmax), mx)
        cur = mse(nearest_int(iscale_i * x).clamp(max=nmax).float(), 1 / iscale_i)
        better = cur < best
        best = torch.where(better, cur, best)
        iscale = torch.where(better.unsqueeze(1), iscale_i, iscale)
    L = nearest_int(iscale * x).clamp(max=nmax).float()
    wx = qw * x
    sumlx, suml2 = seq_sum(wx * L), seq_sum(qw * L * L)
    for _ in range(5):
        for i in range(x.shape[1]):
            xi, wi, wxi, li = x[:, i], qw[:, i], wx[:, i], L[:, i]
            slx = sumlx - wxi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = nearest_int(xi * sl2 / torch.where(ok, slx, 1.0)).clamp(max=nmax).float()
            slx = slx + wxi * new
            sl2 = sl2 + wi * new * new
            take = ok & (new != li) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[:, i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(suml2 > 0, sumlx / _safe(suml2), 0.0)
    L = torch.where(zero.unsqueeze(1), 0, L.to(torch.int32))
    return torch.where(zero, 0.0, scale), L
