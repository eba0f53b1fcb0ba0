"""The launch helpers shared by the Triton kernels."""
import torch

import kernel_util  # noqa: F401  (sets TRITON_INTERPRET without a GPU)
from quanta.kernels import triton_support


def test_pdl_is_opt_in_and_never_under_the_interpreter(monkeypatch):
    try:
        monkeypatch.delenv("QUANTA_PDL", raising=False)
        triton_support.use_pdl.cache_clear()
        assert triton_support.pdl_launch(torch.device("cpu")) == {}
        monkeypatch.setenv("QUANTA_PDL", "1")
        triton_support.use_pdl.cache_clear()
        assert not triton_support.use_pdl(torch.device("cpu"))      # interpreter / no sm90: stays off
        assert triton_support.pdl_launch(torch.device("cpu")) == {}
    finally:
        triton_support.use_pdl.cache_clear()


def test_split_k_keeps_every_split_non_empty():
    for k_tiles in (1, 7, 32, 112):
        for tiles_out in (1, 24, 448):
            splits, per = triton_support.split_k(tiles_out, k_tiles, 132, 16.0, 1)
            assert 1 <= splits <= k_tiles and (splits - 1) * per < k_tiles <= splits * per
