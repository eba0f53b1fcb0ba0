"""ggml's scale searches (ggml-quants.c make_qx_quants, make_q3_quants, make_qkx2/3_quants,
make_qp_quants), vectorized over groups in torch.

Each function takes float32 groups x [G, n] (and weights [G, n]) and returns per-group scales and
integer levels L [G, n], as the C function does for one group. Inside, the groups are columns
(`columns`: [n, G] padded), so each float operation is one tensor op, done in float32 in the C
expression's order, and every sum runs element by element (`running_sum`) as the C loops do, never
as a pairwise reduction. Trials that do not depend on each other are one more tensor axis. Rounding
is ggml's `nearest_int` (round half to even, which torch.round is).
"""
from __future__ import annotations

import numpy as np
import torch

GROUP_MAX_EPS = 1e-15
LANES = 64          # columns of one ATen outer-sum block at the widest vector width (4 x 16 float32, AVX-512)
BLOCK = 512         # columns per pass of the batched trials: their temporaries stay in the caches


def trial_scale(base: float, step: float, i: int, nmax: int) -> float:
    """The C constant `base + step*i + nmax` (base, step float literals, i and nmax int) in float32 steps."""
    f = np.float32
    return float(f(f(base) + f(step) * f(i)) + f(nmax))


def nearest_int(v: torch.Tensor) -> torch.Tensor:
    """ggml nearest_int: round half to even, as int32."""
    return torch.round(v).to(torch.int32)


def padded(g: int) -> int:
    """Columns holding g groups: whole LANES blocks in each thread's share of a sum over rows (`running_sum`)."""
    m = LANES * torch.get_num_threads()
    return -(-g // m) * m


def columns(t: torch.Tensor) -> torch.Tensor:
    """Groups [G, n] -> columns [n, padded(G)] (the padding zero)."""
    out = t.new_zeros(t.shape[1], padded(t.shape[0]))
    out[:, :t.shape[0]] = t.T
    return out


def running_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 in index order, one float32 add at a time from 0 (the C loop's rounding). Overwrites t.

    On the CPU, ATen's sum over dim 0 of at most 16 rows is that running sum, vectorized across the columns,
    when the columns are contiguous and each thread's share is whole LANES blocks (cascade_sum's base case in
    multi_row_sum; a part block would be summed four rows interleaved); longer sums chain windows of 17 rows,
    the first holding the sum so far. Elsewhere the rows are added one by one."""
    if t.device.type != "cpu" or t[0].numel() % (LANES * torch.get_num_threads()):
        acc = t[0].clone()
        for row in t[1:]:
            acc += row
        return acc
    acc = t[:16].sum(0)
    for s in range(16, t.shape[0], 16):
        t[s - 1] = acc
        acc = t[s - 1:s + 16].sum(0)
    return acc


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of t [G, n] in index order, one float32 add at a time (the C loop's rounding)."""
    return running_sum(columns(t))[:t.shape[0]]


def sqrtf(t: torch.Tensor) -> torch.Tensor:
    """C's sqrtf: the correctly rounded float32 square root. torch's vectorized float32 sqrt on the CPU is not
    correctly rounded (it misses on a fraction of a percent of inputs, which moves a K-quant's sub-block scale by
    a step); the float64 root rounded to float32 is exact, since float64 holds more than 2 x 24 + 2 bits."""
    return torch.sqrt(t.double()).to(t.dtype)


def rdiv(c: float, t: torch.Tensor) -> torch.Tensor:
    """c / t rounded once, as C does (torch computes `c / tensor` as c * (1 / tensor): two roundings)."""
    return torch.full_like(t, c) / t


def first_absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The signed value of the first element of largest |x| along `dim`, which goes (C: `if (ax > amax)`)."""
    return x.gather(dim, x.abs().argmax(dim, keepdim=True)).squeeze(dim)


def inverse(d: torch.Tensor) -> torch.Tensor:
    """C `d ? 1.0f/d : 0.0f`."""
    return torch.where(d == 0, 0.0, 1 / torch.where(d == 0, 1.0, d))


def _safe(d: torch.Tensor) -> torch.Tensor:
    """d with zeros replaced by 1, for divisions whose result the caller masks out."""
    return torch.where(d == 0, torch.ones_like(d), d)


def make_qx_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qx_quants with rmse_type 1: symmetric levels L in [0, 2*nmax) (value (L - nmax) * scale)
    chosen by weighted least squares over 19 trial scales; weights qw, or x*x."""
    g, n = x.shape
    x = columns(x)
    w = x * x if qw is None else columns(qw)
    wx = w * x
    mx = first_absmax(x, 0)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = _safe(torch.where(zero, 0.0, mx))
    # the C's first pass (is = 0), then its loop; no trial reads another's result, so all are one axis
    steps = [0] + [i for i in range(-9, 10) if i]
    consts = torch.tensor([trial_scale(0.0, 0.1, i, nmax) for i in steps], device=x.device)
    iscale = -consts.view(-1, 1) / mx                                                               # [T, G]
    nt, cols = len(steps), x.shape[1]
    sums = torch.empty(2, nt, cols, device=x.device)
    for c in range(0, cols, BLOCK):
        xb, iscale_b = x[:, c:c + BLOCK], iscale[:, c:c + BLOCK]
        l = (xb.unsqueeze(1) * iscale_b).round_().clamp_(-nmax, nmax - 1)                     # [n, T, b]
        terms = torch.empty(n, 2, nt, xb.shape[1], device=x.device)
        torch.mul(wx[:, c:c + BLOCK].unsqueeze(1), l, out=terms[:, 0])
        torch.mul(w[:, c:c + BLOCK].unsqueeze(1), l, out=terms[:, 1]).mul_(l)
        sums[:, :, c:c + BLOCK] = running_sum(terms)
    sumlx, suml2 = sums
    scale = torch.where(suml2[0] != 0, sumlx[0] / _safe(suml2[0]), 0.0)
    best = scale * sumlx[0]
    pick = torch.zeros(cols, dtype=torch.int64, device=x.device)
    for t in range(1, nt):
        better = (suml2[t] > 0) & (sumlx[t] * sumlx[t] > best * suml2[t])
        scale = torch.where(better, sumlx[t] / _safe(suml2[t]), scale)
        best = torch.where(better, scale * sumlx[t], best)
        pick = torch.where(better, t, pick)
    L = nearest_int(x * iscale.gather(0, pick.unsqueeze(0))).clamp(-nmax, nmax - 1)
    L = torch.where(zero, 0, L + nmax)
    return torch.where(zero, 0.0, scale)[:g], L.T[:g].contiguous()


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """make_q3_quants with do_rmse: levels by x*x-weighted least squares, refined one element at a
    time (up to five passes) as the C loop does; L in [0, 2*nmax)."""
    g, n = x.shape
    x = columns(x)
    mx = first_absmax(x, 0)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = _safe(torch.where(zero, 0.0, mx))
    w = x * x
    wx = w * x
    L = nearest_int(rdiv(-float(nmax), mx) * x).clamp(-nmax, nmax - 1).float()
    sumlx, suml2 = running_sum(wx * L), running_sum(w * L * L)
    for _ in range(5):          # a pass that changes nothing leaves the next one nothing to change
        for i in range(n):
            xi, wi, wxi, li = x[i], w[i], wx[i], L[i]
            slx = sumlx - wxi * li
            sl2 = suml2 - wi * li * li
            ok = slx > 0
            new = nearest_int(xi * sl2 / torch.where(ok, slx, 1.0)).clamp(-nmax, nmax - 1).float()
            slx = slx + wxi * new
            sl2 = sl2 + wi * new * new
            take = ok & (new != li) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(suml2 > 0, sumlx / _safe(suml2), 0.0)
    L = torch.where(zero, 0, L.to(torch.int32) + nmax)
    return torch.where(zero, 0.0, scale)[:g], L.T[:g].contiguous()


def make_qkx_quants(x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int,
                    use_mad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants / make_qkx3_quants (the same search): asymmetric levels L in [0, nmax] with
    value L * scale - the_min, the (scale, min) pair fitted by weighted least squares over nstep+1
    trial scales. Returns (scale, L, the_min)."""
    g, n = x.shape
    x, w = columns(x), columns(w)
    dev, zero = x.device, x.new_zeros(())
    mn = x.min(0).values.clamp(max=0.0)
    mx = x.max(0).values
    flat = mx == mn
    sums = torch.empty(5, x.shape[1], device=dev)            # sum_l, sum_l2, sum_xl (per trial), sum_w, sum_x
    sums[3:] = running_sum(torch.stack([w, w * x], 1))
    terms = torch.empty(n, 3, x.shape[1], device=dev)
    wl, wl2, wlx = terms.unbind(1)
    # rows of sums whose products make D, and the numerators of the trial's scale and min
    left, right = torch.tensor([3, 0, 3, 4, 1, 0], device=dev), torch.tensor([1, 0, 2, 0, 4, 2], device=dev)
    consts = torch.tensor([float(nmax)] + [trial_scale(rmin, rdelta, i, nmax) for i in range(nstep + 1)],
                          device=dev)

    def err(scale, m, l):
        diff = (l * scale).add_(m).sub_(x)
        diff = diff.abs_() if use_mad else diff.mul_(diff)
        return running_sum(diff.mul_(w))

    def levels(iscale, m):
        return ((x - m) * iscale).round_().clamp_(0, nmax)

    # divisions by zero below give inf / nan only in groups that no comparison lets through
    iscale = consts[0] / torch.where(flat, 1.0, mx - mn)
    scale = 1 / iscale
    # the running best: error, scale, and the trial's iscale and min that make its levels again at the end
    state = torch.stack([err(scale, mn, levels(iscale, mn)), scale, iscale, mn, mn])
    best, scale, best_iscale, best_at, cur = state
    for i in range(nstep + 1):
        # the C loop reads `min` after each improvement: later trials start from the best min so far
        iscale = consts[i + 1] / (mx - cur)
        l = levels(iscale, cur)
        torch.mul(w, l, out=wl)
        torch.mul(wl, l, out=wl2)
        torch.mul(wl, x, out=wlx)
        sums[:3] = running_sum(terms)
        prod = sums[left] * sums[right]
        dn = prod[0::2] - prod[1::2]                           # D, D * this_scale, D * this_min
        this_scale, this_min = dn[1:] / dn[0]
        pos = this_min > 0
        this_min = torch.where(pos, zero, this_min)
        this_scale = torch.where(pos, sums[2] / sums[1], this_scale)
        cur_err = err(this_scale, this_min, l)
        better = (dn[0] > 0) & (cur_err < best)
        state = torch.where(better, torch.stack([cur_err, this_scale, iscale, cur, this_min]), state)
        best, scale, best_iscale, best_at, cur = state
    L = torch.where(flat, 0, levels(best_iscale, best_at).to(torch.int32))
    return torch.where(flat, 0.0, scale)[:g], L.T[:g].contiguous(), torch.where(flat, -mn, -cur)[:g]


def make_qp_quants(x: torch.Tensor, nmax: int, qw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """make_qp_quants: levels L in [0, nmax] (value L * scale) for non-negative x (the sub-block
    scales of the imatrix K-quants), weighted by qw, refined element by element."""
    g, n = x.shape
    x, qw = columns(x), columns(qw)
    mx = x.max(0).values.clamp(min=0.0)
    zero = mx < GROUP_MAX_EPS
    mx = _safe(torch.where(zero, 0.0, mx))

    def mse(l, scale):
        diff = x - scale * l
        return running_sum(qw * diff * diff)

    iscale = rdiv(float(nmax), mx)
    best = mse(nearest_int(iscale * x).float(), 1 / iscale)
    for i in range(-4, 5):
        if i == 0:
            continue
        iscale_i = rdiv(trial_scale(0.0, 0.1, i, nmax), mx)
        cur = mse(nearest_int(iscale_i * x).clamp(max=nmax).float(), 1 / iscale_i)
        better = cur < best
        best = torch.where(better, cur, best)
        iscale = torch.where(better, iscale_i, iscale)
    L = nearest_int(iscale * x).clamp(max=nmax).float()
    wx = qw * x
    sumlx, suml2 = running_sum(wx * L), running_sum(qw * L * L)
    for _ in range(5):
        for i in range(n):
            xi, wi, wxi, li = x[i], qw[i], wx[i], L[i]
            slx = sumlx - wxi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = nearest_int(xi * sl2 / torch.where(ok, slx, 1.0)).clamp(max=nmax).float()
            slx = slx + wxi * new
            sl2 = sl2 + wi * new * new
            take = ok & (new != li) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            L[i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx, sumlx)
            suml2 = torch.where(take, sl2, suml2)
    scale = torch.where(suml2 > 0, sumlx / _safe(suml2), 0.0)
    L = torch.where(zero, 0, L.to(torch.int32))
    return torch.where(zero, 0.0, scale)[:g], L.T[:g].contiguous()
