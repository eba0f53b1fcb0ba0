"""loaders.pages.release: mapped checkpoint pages leave the resident set, values stay, kept storages stay."""
from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT is Linux's")


def rss_file() -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssFile"))


def test_released_pages_leave_the_resident_set_and_values_stay(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from quanta.loaders.pages import release
    g = torch.Generator().manual_seed(0)
    save_file({"a": torch.randn(4096, 2048, generator=g), "b": torch.randn(4096, 2048, generator=g)},
              str(tmp_path / "w.safetensors"))
    handle = safe_open(str(tmp_path / "w.safetensors"), framework="pt")
    a, b = handle.get_tensor("a"), handle.get_tensor("b")
    sums = (a.sum().item(), b.sum().item())                   # every page read, so mapped and resident
    before = rss_file()
    release([a, b], keep=[b])                                  # b is still in use where it lies
    dropped = before - rss_file()
    assert 28 << 20 < dropped < 36 << 20, dropped              # a's 32 MiB, not b's
    assert (a.sum().item(), b.sum().item()) == sums            # read back from the file, unchanged


def test_tensors_of_walks_states_and_qtensors():
    from quanta.loaders.pages import tensors_of
    t, u = torch.zeros(3), torch.ones(2)

    class State:
        def __init__(self):
            self.parts, self.meta, self.name = {"w": t}, [u, None], "x"
    assert [x.data_ptr() for x in tensors_of([State(), None])] == [t.data_ptr(), u.data_ptr()]
