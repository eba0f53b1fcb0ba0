"""llama-imatrix's files read as llama-quantize reads them (loaders/gguf/imatrix.py), and `quanta quantize
--imatrix FILE` refusing what cannot apply before any work. The files are written here in llama.cpp's layouts:
the GGUF one with the gguf package, the legacy one byte by byte (tools/imatrix's save_imatrix_legacy)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

import quanta
from quanta.cli.quantize import register
from quanta.quant.errors import ConfigError, CorruptFileError, ShapeError
from quanta.loaders.gguf.imatrix import load_imatrix, read_imatrix, write_imatrix


def gguf_imatrix(path, entries: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    import gguf
    w = gguf.GGUFWriter(str(path), "imatrix")
    w.add_array("imatrix.datasets", ["wiki.train.raw"])
    w.add_uint32("imatrix.chunk_count", 100), w.add_uint32("imatrix.chunk_size", 512)
    for name, (sums, counts) in entries.items():
        w.add_tensor(f"{name}.in_sum2", sums.astype(np.float32))
        w.add_tensor(f"{name}.counts", counts.astype(np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def legacy_imatrix(path, entries: dict[str, tuple[int, np.ndarray]], trailer: bool = True) -> None:
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        raw = name.encode()
        out += struct.pack("<i", len(raw)) + raw + struct.pack("<ii", ncall, values.size)
        out += values.astype("<f4").tobytes()
    if trailer:                                   # last call and the dataset's name, as newer llama-imatrix adds
        out += struct.pack("<i", 100) + struct.pack("<i", 14) + b"wiki.train.raw"
    path.write_bytes(out)


def test_gguf_layout_is_sums_over_counts_per_expert(tmp_path):
    rng = np.random.default_rng(0)
    dense = rng.lognormal(0, 2, 64).astype(np.float32) * 300
    experts = rng.lognormal(0, 2, (3, 32)).astype(np.float32)
    gguf_imatrix(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (dense, np.array([300.0])),
                                       "blk.0.ffn_down_exps.weight": (experts.reshape(-1), np.array([7.0, 0.0, 2.5]))})
    w = read_imatrix(tmp_path / "m.gguf")
    assert torch.equal(w["blk.0.attn_q.weight"], torch.from_numpy(dense / np.float32(300)))
    want = np.concatenate([experts[0] / np.float32(7), np.ones(32, np.float32), experts[2] / np.float32(3)])
    assert torch.equal(w["blk.0.ffn_down_exps.weight"], torch.from_numpy(want))    # count 2.5 rounds to 3 (lround)


def test_legacy_layout_divides_by_ncall(tmp_path):
    rng = np.random.default_rng(1)
    a, b = rng.random(64, dtype=np.float32) * 10, rng.random(128, dtype=np.float32)
    for trailer in (True, False):
        legacy_imatrix(tmp_path / "m.dat", {"blk.0.attn_q.weight": (10, a), "output.weight": (0, b)}, trailer)
        w = read_imatrix(tmp_path / "m.dat")
        assert torch.equal(w["blk.0.attn_q.weight"], torch.from_numpy(a / np.float32(10)))
        assert torch.equal(w["output.weight"], torch.from_numpy(b))


def test_datasets_and_chunks_become_llama_quantizes_metadata(tmp_path):
    """The legacy trailer (last call, dataset name) and the GGUF layout's imatrix.datasets / chunk_count give the
    quantize.imatrix.* entries llama-quantize writes; strings are cut at 127 bytes as its 128-byte buffers cut."""
    entries = {"blk.0.attn_q.weight": (4, np.ones(64, np.float32)), "output.weight": (2, np.ones(8, np.float32))}
    legacy_imatrix(tmp_path / "m.dat", entries, trailer=True)
    found = load_imatrix(tmp_path / "m.dat")
    assert (found.datasets, found.chunk_count) == (["wiki.train.raw"], 100)
    long = "d/" * 80 + "m.dat"
    assert found.quantize_metadata(long) == {"quantize.imatrix.file": long[:127],
                                             "quantize.imatrix.dataset": "wiki.train.raw",
                                             "quantize.imatrix.entries_count": 2, "quantize.imatrix.chunks_count": 100}
    legacy_imatrix(tmp_path / "bare.dat", entries, trailer=False)
    assert load_imatrix(tmp_path / "bare.dat").quantize_metadata("bare.dat") == {
        "quantize.imatrix.file": "bare.dat", "quantize.imatrix.entries_count": 2}
    write_imatrix(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (torch.ones(64), 3)}, ["a.txt", "b.txt"], 7, 512)
    found = load_imatrix(tmp_path / "m.gguf")
    assert (found.datasets, found.chunk_count) == (["a.txt", "b.txt"], 7)


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_bytes(b""), "cut short"),
    (lambda p: p.write_bytes(p.read_bytes()[:40]), "cut short in entry 0"),
    (lambda p: p.write_bytes(struct.pack("<i", 0)), "0 entries"),
])
def test_damaged_legacy_files_are_refused(tmp_path, damage, match):
    legacy_imatrix(tmp_path / "m.dat", {"blk.0.attn_q.weight": (4, np.ones(64, np.float32))}, trailer=False)
    damage(tmp_path / "m.dat")
    with pytest.raises(CorruptFileError, match=match):
        read_imatrix(tmp_path / "m.dat")


def test_unpaired_and_non_finite_entries_are_refused(tmp_path):
    import gguf
    w = gguf.GGUFWriter(str(tmp_path / "half.gguf"), "imatrix")
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones(64, np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CorruptFileError, match="blk.0.attn_q.weight has .in_sum2 but not both"):
        read_imatrix(tmp_path / "half.gguf")
    legacy_imatrix(tmp_path / "nan.dat", {"blk.1.ffn_up.weight": (1, np.array([1.0, np.nan], np.float32))})
    with pytest.raises(CorruptFileError, match="'blk.1.ffn_up.weight' holds values that are not finite"):
        read_imatrix(tmp_path / "nan.dat")


def test_quantize_refuses_an_imatrix_of_another_shape_before_work(tmp_path, default_model_path):
    legacy_imatrix(tmp_path / "m.dat", {"blk.3.ffn_down.weight": (1, np.ones(576, np.float32))})
    with pytest.raises(ShapeError, match="'blk.3.ffn_down.weight' has 576 values but the weight has 1536 columns"):
        quanta.quantize(default_model_path, tmp_path / "out.gguf", "gguf", type="Q4_K_M", imatrix=tmp_path / "m.dat",
                        quiet=True)
    assert not (tmp_path / "out.gguf").exists()


def test_imatrix_file_options(tmp_path, default_model_path):
    with pytest.raises(ConfigError, match="imatrix file .* does not exist"):
        quanta.quantize(default_model_path, tmp_path / "o.gguf", "gguf", type="Q4_0", imatrix=tmp_path / "none.dat")
    legacy_imatrix(tmp_path / "m.dat", {"blk.0.attn_q.weight": (1, np.ones(576, np.float32))})
    with pytest.raises(ConfigError, match="imatrix is a GGUF option"):
        quanta.quantize(default_model_path, tmp_path / "o", "awq", imatrix=tmp_path / "m.dat")
    with pytest.raises(ConfigError, match="an imatrix file replaces it"):
        quanta.quantize(default_model_path, tmp_path / "o.gguf", "gguf", type="Q4_0", imatrix=tmp_path / "m.dat",
                        calibration=tmp_path / "m.dat")


def test_cli_takes_a_file_or_the_bare_flag():
    import argparse
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["quantize", "m.gguf", "--method", "gguf", "--type", "Q4_K_M", "--out", "o.gguf"]
    assert parser.parse_args(base + ["--imatrix", "imatrix.gguf"]).imatrix == "imatrix.gguf"
    assert parser.parse_args(base + ["--imatrix"]).imatrix is True
    assert parser.parse_args(base).imatrix is False

