"""Pickle checkpoints (.bin / .pt) are never unpickled without the explicit allow_pickle=True opt-in, and
with it only through torch.load(weights_only=True); the refusal is a typed error naming the opt-in."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

from quanta.loaders import load
from quanta.quant.errors import CorruptFileError, UnsupportedError
from quanta.cli.main import main
from test_fuzz_safetensors import CONFIG, seed_tensors


@pytest.fixture
def pickle_dir(tmp_path):
    """A plain HF checkpoint saved as pytorch_model.bin; torch.load fails the test unless allowed."""
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    torch.save(seed_tensors(), path / "pytorch_model.bin")
    return path


def forbid_torch_load(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("torch.load was called without allow_pickle=True")
    monkeypatch.setattr(torch, "load", refuse)


def test_refused_by_default_without_unpickling(pickle_dir, monkeypatch):
    forbid_torch_load(monkeypatch)
    with pytest.raises(UnsupportedError, match=r"pytorch_model\.bin.*can run code.*allow_pickle=True"):
        load(pickle_dir)


def test_quantized_families_refuse_pickles(pickle_dir, monkeypatch):
    """The quantized loaders have no opt-in at all: an AWQ config over .bin weights is refused."""
    forbid_torch_load(monkeypatch)
    cfg = {**CONFIG, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 32}}
    (pickle_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError, match=r"pytorch_model\.bin.*allow_pickle=True"):
        load(pickle_dir)


def test_cli_refuses_and_names_the_opt_in(pickle_dir, monkeypatch, capsys):
    forbid_torch_load(monkeypatch)
    assert main(["inspect", str(pickle_dir)]) == 2
    err = capsys.readouterr().err
    assert "quanta: error:" in err and "pytorch_model.bin" in err and "allow_pickle=True" in err


def test_opt_in_loads_only_weights(pickle_dir, tmp_path):
    """With the opt-in, tensors load; a pickle carrying code is refused by weights_only, its code not run."""
    ck = load(pickle_dir, allow_pickle=True)
    want = seed_tensors()
    assert all(torch.equal(ck.tensors[n], want[n]) for n in ck.tensors)

    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return open, (str(marker), "w")
    (pickle_dir / "pytorch_model.bin").write_bytes(pickle.dumps({"model.norm.weight": Payload()}))
    with pytest.raises(CorruptFileError, match="weights_only=True"):
        load(pickle_dir, allow_pickle=True)
    assert not marker.exists()
