"""The vectorized ggml scale searches (quant/ggml/qsearch.py) against ggml-quants.c's loops written out one group
at a time in numpy float32 scalars (IEEE single, the C's rounding), and `running_sum` against a plain loop of adds.
The golden blocks of llama.cpp itself are in test_ggml_quantize.py."""
import numpy as np
import pytest
import torch

from quanta.quant.ggml.qsearch import columns, make_qkx_quants, make_qx_quants, running_sum, seq_sum, trial_scale

f32 = np.float32


def _loop_sum(t: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros_like(t[0])
    for row in t:
        acc += row
    return acc


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_running_sum_adds_one_row_at_a_time(threads):
    n0 = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        for n in (1, 2, 15, 16, 17, 18, 32, 33, 256):
            for shape in ((n, 5), (n, 3, 700), (n, 2, 19, 130)):
                t = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-3, 4, shape, generator=g)
                want = _loop_sum(t)
                assert torch.equal(seq_sum(t.reshape(n, -1).T.contiguous()), want.reshape(-1)), (n, shape)
                padded = columns(t.reshape(n, -1).T)
                assert torch.equal(running_sum(padded)[:want.numel()], want.reshape(-1)), (n, shape)
    finally:
        torch.set_num_threads(n0)


def _nearest(v):
    return int(np.rint(v))


def ref_qkx(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants, line by line."""
    n = len(x)
    mn, mx, sum_w = x[0], x[0], w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        mn, mx = min(mn, x[i]), max(mx, x[i])
        sum_w += w[i]
        sum_x += w[i] * x[i]
    mn = min(mn, f32(0))
    if mx == mn:
        return f32(0), [0] * n, -mn
    iscale = f32(nmax) / (mx - mn)
    scale = f32(1) / iscale
    L, best = [0] * n, f32(0)
    for i in range(n):
        L[i] = max(0, min(nmax, _nearest(iscale * (x[i] - mn))))
        diff = scale * f32(L[i]) + mn - x[i]
        best += w[i] * (abs(diff) if use_mad else diff * diff)
    for s in range(nstep + 1):
        iscale = f32(trial_scale(rmin, rdelta, s, nmax)) / (mx - mn)
        aux = [max(0, min(nmax, _nearest(iscale * (x[i] - mn)))) for i in range(n)]
        sum_l = sum_l2 = sum_xl = f32(0)
        for i in range(n):
            wl = w[i] * f32(aux[i])
            sum_l += wl
            sum_l2 += wl * f32(aux[i])
            sum_xl += wl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min, this_scale = f32(0), sum_xl / sum_l2
            err = f32(0)
            for i in range(n):
                diff = this_scale * f32(aux[i]) + this_min - x[i]
                err += w[i] * (abs(diff) if use_mad else diff * diff)
            if err < best:
                L, best, scale, mn = aux, err, this_scale, this_min
    return scale, L, -mn


def ref_qx(x, nmax):
    """make_qx_quants with rmse_type 1 and no weights, line by line."""
    amax, mx = f32(0), f32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < 1e-15:
        return f32(0), [0] * len(x)

    def trial(iscale):
        ls = [max(-nmax, min(nmax - 1, _nearest(iscale * v))) for v in x]
        sumlx = suml2 = f32(0)
        for v, q in zip(x, ls):
            sumlx += v * v * v * f32(q)
            suml2 += v * v * f32(q) * f32(q)
        return ls, sumlx, suml2

    L, sumlx, suml2 = trial(f32(-nmax) / mx)
    scale = sumlx / suml2 if suml2 else f32(0)
    best = scale * sumlx
    for s in [i for i in range(-9, 10) if i]:
        ls, sumlx, suml2 = trial(-f32(trial_scale(0.0, 0.1, s, nmax)) / mx)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L, scale = ls, sumlx / suml2
            best = scale * sumlx
    return scale, [q + nmax for q in L]


def _groups(n, seed):
    g = np.random.default_rng(seed)
    x = (g.standard_normal((200, n)) * g.choice([1e-3, 1.0, 30.0], (200, 1))).astype(np.float32)
    x[0] = 0.5                                   # flat
    x[1] = np.abs(x[1])                           # all positive: the min is clamped to 0
    x[2, : n // 2] = 0.0
    return x


@pytest.mark.parametrize("args", [(15, -1.0, 0.1, 20, False), (3, -0.5, 0.1, 15, True), (31, -0.9, 0.05, 36, False)])
def test_make_qkx_quants_is_the_c_loop(args):
    x = _groups(16 if args[0] == 3 else 32, 0)
    w = (np.abs(x) + np.float32(0.25)).astype(np.float32)
    scale, L, the_min = make_qkx_quants(torch.from_numpy(x), torch.from_numpy(w), *args)
    for j in range(len(x)):
        s, lv, m = ref_qkx(list(x[j]), list(w[j]), *args)
        assert (scale[j].item(), L[j].tolist(), the_min[j].item()) == (float(s), lv, float(m)), j


@pytest.mark.parametrize("nmax", [32, 16])
def test_make_qx_quants_is_the_c_loop(nmax):
    x = _groups(16, nmax)
    scale, L = make_qx_quants(torch.from_numpy(x), nmax)
    for j in range(len(x)):
        s, lv = ref_qx(list(x[j]), nmax)
        assert (scale[j].item(), L[j].tolist()) == (float(s), lv), j
