"""The row counts the engine's start-up runs (path_table.row_classes) against every plan's choices."""
import pytest
import torch

from kernel_util import DEVICE  # noqa: I001  (sets TRITON_INTERPRET without a GPU)
from quanta.kernels import affine, ggml_gemm
from quanta.kernels.affine import plan as affine_plan
from quanta.kernels.device_caps import PRESETS
from quanta.kernels.ggml import plan as ggml_plan
from quanta.kernels.path_table import row_classes
from test_affine_gemm import make_affine
from test_ggml_gemm import make_gguf

LIMIT = 1500


def weights():
    yield affine_plan.TABLE, affine.prepare(make_affine(256, 512, 4, 128, "sym"), DEVICE, torch.float16)
    yield affine_plan.TABLE, affine.prepare(make_affine(256, 512, 4, 32, "asym"), DEVICE, torch.float16)
    yield ggml_plan.TABLE, ggml_gemm.prepare(make_gguf(256, 512, "Q4_K")[0], DEVICE, torch.float16)
    yield ggml_plan.TABLE, ggml_gemm.prepare(make_gguf(256, 512, "Q6_K")[0], DEVICE, torch.float16)


@pytest.mark.parametrize("caps", ["sm90", "sm80", "sm75"])
def test_row_classes_meet_every_choice_of_every_plan(caps):
    """Each (path, launch config, M divisible by 16, M = 1) that a plan gives some M up to LIMIT, it gives one of
    row_classes(LIMIT): the start-up run over those compiles what any step will launch."""
    sizes = row_classes(LIMIT)
    assert sizes[0] == 1 and sizes[-1] == LIMIT and len(sizes) < 100
    for table, st in weights():
        def key(m):
            choice = table.choose(st, PRESETS[caps], m)
            return choice.path.name, tuple(choice.config), m % 16 == 0, m == 1
        assert {key(m) for m in range(1, LIMIT + 1)} == {key(m) for m in sizes}


def test_row_classes_keep_both_ends_of_a_class():
    """Above every table's last edge one bucket remains: its smallest and largest M of each divisibility."""
    sizes = row_classes(4000)
    assert {3999, 4000} <= set(sizes) and not {2000, 3000} & set(sizes)
