"""The launch helpers shared by the Triton kernels."""
from dataclasses import replace

import pytest
import torch

import kernel_util  # noqa: F401  (sets TRITON_INTERPRET without a GPU)
from quanta.kernels import triton_support
from quanta.kernels.device_caps import PRESETS, device_caps


def test_pdl_follows_the_device_caps():
    """PDL launch keywords exactly where the caps say PDL (sm90 with Triton's griddepcontrol), never on the CPU's
    interpreter, and not on a chip the caps stand for that lacks it (QUANTA_DEVICE_CAPS=sm80 on an H100). Off, the
    PDL constexpr is still given: the Gluon kernels' has no default, and QUANTA_PDL=0 on sm90 launches them."""
    assert triton_support.pdl_launch(PRESETS["sm90"]) == {"PDL": True, "launch_pdl": True}
    for name in ("sm89", "sm80", "sm75", "cpu"):
        assert triton_support.pdl_launch(PRESETS[name]) == {"PDL": False}
    assert triton_support.pdl_launch(replace(PRESETS["sm90"], pdl=False)) == {"PDL": False}
    assert not device_caps("cpu").pdl


def test_bf16_refused_where_the_caps_lack_it():
    """why_not_device asks the device's caps about bf16 (CUDA only: the CPU is refused first)."""
    assert "CUDA" in triton_support.why_not_device(torch.device("cpu"), torch.bfloat16)
    assert "float32" in triton_support.why_not_device(torch.device("cuda"), torch.float32)
    assert not PRESETS["sm75"].supports_dtype(torch.bfloat16) and PRESETS["sm80"].supports_dtype(torch.bfloat16)


def test_split_k_keeps_every_split_non_empty():
    for k_tiles in (1, 7, 32, 112):
        for tiles_out in (1, 24, 448):
            splits, per = triton_support.split_k(tiles_out, k_tiles, 132, 16.0, 1)
            # about 16 waves of 132 programs, as far as K has tiles: never fewer than half that, never more
            wanted = min(max(1, round(16.0 * 132 / tiles_out)), k_tiles)
            assert wanted / 2 < splits <= wanted, (k_tiles, tiles_out, splits, wanted)
            assert (splits - 1) * per < k_tiles, "the last split would get no K tile"
            assert k_tiles <= splits * per, "some K tiles would belong to no split"


def test_whole_wave_split_k_fills_the_last_wave_and_covers_k():
    for k_tiles in (1, 7, 32, 64, 224):
        for tiles_out in (1, 48, 80, 132, 224, 264):
            splits, per = triton_support.whole_wave_split_k(tiles_out, k_tiles, 132, 4)
            assert splits <= max(1, k_tiles // 4), "a split would get fewer than min_tiles K tiles"
            assert (splits - 1) * per < k_tiles <= splits * per, (k_tiles, tiles_out, splits, per)
            if tiles_out % 132 == 0:                       # whole waves already: nothing to gain by splitting
                assert splits == 1, (k_tiles, tiles_out, splits)
    # 48 programs leave 84 of 132 SMs idle: a long K is split to fill them
    assert triton_support.whole_wave_split_k(48, 32, 132, 4)[0] > 1


def test_stream_k_covers_every_step_once_in_runs_that_cross_at_most_one_tile():
    for k_tiles in (1, 7, 32, 224):
        for tiles_out in (1, 48, 131, 132, 224, 448):
            whole, iters, programs, steps = triton_support.stream_k(tiles_out, k_tiles, 132)
            assert whole % 132 == 0 and tiles_out - 132 < whole <= tiles_out, (tiles_out, whole)
            rest = (tiles_out - whole) * k_tiles
            assert programs <= 132 and (programs - 1) * iters < rest <= programs * iters or rest == programs == 0
            assert iters <= k_tiles, "a run would span three tiles"
            assert steps <= triton_support.wave_steps(tiles_out, k_tiles, 132, 1) + 6
    # 48 tiles of 32 K tiles on 132 SMs: streamed in runs of 12 steps, against 2 splits of 16
    assert triton_support.stream_k(48, 32, 132)[1:3] == (12, 128)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("numel", [1, 4096, 4097, 3 * 4096 + 5])
def test_zero_clears_every_element_and_nothing_past_the_tensor(numel, dtype):
    """The in-place Triton zeroing of a split-K output: every element, across a partial last block, and not
    one element of the storage beyond the tensor's end."""
    storage = torch.full((numel + 64,), 7.0, dtype=dtype)
    y = storage[:numel]
    assert triton_support.zero_(y) is y
    assert torch.equal(y, torch.zeros(numel, dtype=dtype))
    assert torch.equal(storage[numel:], torch.full((64,), 7.0, dtype=dtype))
