"""Gguf kind and the GGML type table, bit-exact against the `gguf` package (gguf-py 0.19)."""
import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T

import quanta.quant.kinds.gguf as gguf_kind
from quanta.quant.errors import ShapeError, UnsupportedError
from quanta.quant.ggml.types import GGML_TYPES, ggml_type
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.gguf import Gguf

# Byte offsets of the f16 scale fields of each type; random bytes there would often be NaN/Inf.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q8_1": [0, 2],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "TQ1_0": [52], "TQ2_0": [64], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0],
    "IQ3_S": [0], "IQ1_S": [0], "IQ4_NL": [0], "IQ4_XS": [0], "Q1_0": [0],
}
ORACLE_TYPES = [T.F32, T.F16] + sorted(quants._type_traits, key=int)   # what gguf-py can dequantize
LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]


def random_blocks(t: T, n: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """Random uint8 rows [n, blocks_per_row * type_size] with finite f16 scale fields."""
    rng = np.random.default_rng(seed + int(t))
    ts = GGML_TYPES[int(t)].type_size
    if t in (T.F32, T.F16, T.BF16):
        dtype = {T.F32: np.float32, T.F16: np.float16, T.BF16: np.float32}[t]
        x = rng.standard_normal((n, blocks_per_row)).astype(dtype)
        if t == T.BF16:
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n, -1)
        return x.view(np.uint8).reshape(n, -1)
    data = rng.integers(0, 256, size=(n * blocks_per_row, ts), dtype=np.uint8)
    for off in F16_FIELDS.get(t.name, []):
        data[:, off:off + 2] = rng.uniform(-3, 3, (data.shape[0], 1)).astype(np.float16).view(np.uint8)
    return data.reshape(n, -1)


def assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Bit-for-bit equality, NaN positions included (IQ1_M builds its f16 scale from spread bits)."""
    ours, ref = ours.float(), ref.float()
    assert torch.equal(torch.isnan(ours), torch.isnan(ref))
    assert torch.equal(ours.nan_to_num(0.0), ref.nan_to_num(0.0)), (ours - ref).abs().nan_to_num(0).max()


def as_gguf(data: np.ndarray, t: T) -> Gguf:
    k = data.shape[1] // GGML_TYPES[int(t)].type_size * GGML_TYPES[int(t)].block_size
    return Gguf(torch.from_numpy(np.ascontiguousarray(data)), int(t), (data.shape[0], k))


# --- the type table ---------------------------------------------------------------------------------
def test_table_matches_gguf_quant_sizes():
    for t in T:
        ours = GGML_TYPES[int(t)]
        assert ours.name.upper() == t.name and ours.id == int(t) and ours.retired is None
        if t == T.Q8_1:   # gguf-py's entry predates ggml's f16 d/s: ggml-common.h asserts 36 bytes
            assert (ours.block_size, ours.type_size, GGML_QUANT_SIZES[t]) == (32, 36, (32, 40))
            continue
        assert (ours.block_size, ours.type_size) == GGML_QUANT_SIZES[t], t.name


def test_table_rows_say_how_to_read_each_type():
    live = [t for t in GGML_TYPES.values() if not t.retired]
    assert all(t.decode is None and t.affine is None for t in GGML_TYPES.values() if t.retired)
    assert {T(t.id) for t in live if t.decode} >= set(ORACLE_TYPES) | {T.BF16, T.Q8_1, T.Q8_K, T.Q1_0}
    assert {t.name: t.float_dtype for t in live if t.float_dtype} == \
        {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    assert all(t.block_size == 1 and t.float_dtype.itemsize == t.type_size for t in live if t.float_dtype)
    affine = {T(t.id): t.affine for t in live if t.affine}
    assert set(affine) == set(LEGACY)
    for t, (bits, zero) in affine.items():   # d f16, [m f16], 32 codes of `bits` bits
        assert GGML_QUANT_SIZES[t] == (32, 2 + (2 if zero is None else 0) + 32 * bits // 8), t.name


@pytest.mark.parametrize("type_id, instead", [(4, "q4_0"), (5, "q4_1"), (31, "q4_0"), (32, "q4_0"),
                                              (33, "q4_0"), (36, "iq4_nl"), (37, "iq4_nl"), (38, "iq4_nl")])
def test_retired_ids_are_tombstones(type_id, instead):
    assert GGML_TYPES[type_id].retired
    with pytest.raises(UnsupportedError, match=rf"blk\.0\.x.*{GGML_TYPES[type_id].name}.*{instead}"):
        ggml_type(type_id, "blk.0.x")


def test_unknown_id():
    with pytest.raises(UnsupportedError, match="99"):
        ggml_type(99)


# --- dequantize, bit for bit against gguf.quants.dequantize -----------------------------------------
@pytest.mark.parametrize("t", ORACLE_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(t):
    data = random_blocks(t, n=5, blocks_per_row=3 if GGML_TYPES[int(t)].block_size > 1 else 96)
    ref = torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, t)))
    q = as_gguf(data, t)
    assert_same(q.dequantize(), ref)
    assert q.dequantize(torch.float16).dtype == torch.float16
    assert_same(q.dequantize(torch.bfloat16), ref.to(torch.bfloat16))


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4])
def test_dequantize_gguf_quantized_weights(t):
    w = np.random.default_rng(1).standard_normal((7, 512)).astype(np.float32)
    data = quants.quantize(w, t)
    assert_same(as_gguf(data, t).dequantize(), torch.from_numpy(quants.dequantize(data, t)))


def test_types_without_gguf_oracle_follow_ggml_structs():
    # gguf-py cannot decode these; the references below are ggml-common.h's block structs read directly
    data = random_blocks(T.Q8_1, 3, 2)
    b = data.reshape(-1, 36)
    ref = b[:, 4:].view(np.int8).astype(np.float32) * b[:, :2].view(np.float16).astype(np.float32)
    assert_same(as_gguf(data, T.Q8_1).dequantize(), torch.from_numpy(ref.reshape(3, 64)))

    data = np.random.default_rng(2).integers(0, 256, (6, 292), dtype=np.uint8)
    data[:, :4] = np.random.default_rng(3).uniform(-1, 1, (6, 1)).astype(np.float32).view(np.uint8)
    ref = data[:, 4:260].view(np.int8).astype(np.float32) * data[:, :4].view(np.float32)
    assert_same(as_gguf(data.reshape(3, -1), T.Q8_K).dequantize(), torch.from_numpy(ref.reshape(3, 512)))

    data = random_blocks(T.Q1_0, 2, 2)
    b = data.reshape(-1, 18)
    bits = np.unpackbits(b[:, 2:], axis=1, bitorder="little").astype(np.float32)
    ref = (2 * bits - 1) * b[:, :2].view(np.float16).astype(np.float32)
    assert_same(as_gguf(data, T.Q1_0).dequantize(), torch.from_numpy(ref.reshape(2, 256)))


def test_dequantize_in_several_chunks(monkeypatch):
    data = random_blocks(T.Q4_K, n=3, blocks_per_row=5)
    whole = as_gguf(data, T.Q4_K).dequantize()
    monkeypatch.setattr(gguf_kind, "_CHUNK_BLOCKS", 4)
    assert torch.equal(as_gguf(data, T.Q4_K).dequantize(), whole)


def test_real_file_blocks(default_model_path):
    from gguf import GGUFReader
    reader = GGUFReader(default_model_path)
    tensors = {t.name: t for t in reader.tensors}
    for name, rows in (("blk.0.attn_q.weight", slice(None)), ("blk.7.ffn_down.weight", slice(None)),
                       ("token_embd.weight", slice(1000, 1700))):
        t = tensors[name]
        data = np.array(t.data[rows])
        ref = torch.from_numpy(quants.dequantize(data, t.tensor_type))
        q = as_gguf(data, t.tensor_type)
        assert_same(q.dequantize(), ref)
        assert_same(q.to_affine().dequantize(), ref)
        assert q.describe() == f"gguf {t.tensor_type.name.lower()}"


# --- affine form, rows, geometry --------------------------------------------------------------------
@pytest.mark.parametrize("t", LEGACY, ids=lambda t: t.name)
def test_to_affine_is_exact(t):
    q = as_gguf(random_blocks(t, n=4, blocks_per_row=3), t)
    a = q.to_affine()
    assert isinstance(a, Affine) and a.codes.dtype == torch.uint8 and a.group_size == 32
    assert a.scales.dtype == torch.float16 and a.bits == {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}.get(t, 5)
    assert (a.mins is not None) == (t in (T.Q4_1, T.Q5_1))
    assert int(a.codes.max()) < 2 ** a.bits
    assert_same(a.dequantize(), q.dequantize())


def test_to_affine_none_for_other_types():
    assert as_gguf(random_blocks(T.Q4_K, 2, 1), T.Q4_K).to_affine() is None


def test_take_rows_nbytes_describe():
    q = as_gguf(random_blocks(T.Q6_K, n=6, blocks_per_row=2), T.Q6_K)
    idx = [5, 0, 3]
    sub = q.take_rows(idx)
    assert sub.shape == (3, 512) and torch.equal(sub.dequantize(), q.dequantize()[idx])
    assert torch.equal(q.take_rows(slice(1, 3)).dequantize(), q.dequantize()[1:3])
    assert q.nbytes == 6 * 2 * 210 and q.bits_per_weight == pytest.approx(6.5625)
    assert q.describe() == "gguf q6_K" and "q6_K" in repr(q)


def test_validation_errors():
    data = torch.zeros(4, 36, dtype=torch.uint8)
    assert Gguf(data, int(T.Q4_0), (4, 64)).numel == 256
    with pytest.raises(ShapeError, match=r"q4_0.*uint8 \[4, 72\]"):
        Gguf(data, int(T.Q4_0), (4, 128))
    with pytest.raises(ShapeError, match="multiple of the block size 32"):
        Gguf(data, int(T.Q4_0), (4, 48))
    with pytest.raises(ShapeError, match="uint8"):
        Gguf(data.to(torch.int16), int(T.Q4_0), (4, 64))
    with pytest.raises(UnsupportedError, match="q4_2"):
        Gguf(data, 4, (4, 64))
    with pytest.raises(UnsupportedError, match="i8"):
        Gguf(data, int(T.I8), (4, 36)).dequantize()


def test_decoder_tables_are_made_once_a_device():
    """The decoders' constant tables (IQ4's values, the i-quant grids and sign tables) are copied to a device once,
    so that a decode inside a captured CUDA graph makes no copy from host memory (the GPU test below)."""
    from quanta.quant.ggml import blocks, iquants
    cpu = torch.device("cpu")
    assert blocks.lut(iquants.IQ4_NL_VALUES, cpu) is blocks.lut(iquants.IQ4_NL_VALUES, "cpu")
    assert iquants.grid("IQ2_XXS", cpu) is iquants.grid("IQ2_XXS", cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [t for t in ORACLE_TYPES if t not in (T.F32, T.F16)], ids=lambda t: t.name)
def test_row_lookup_runs_inside_a_captured_cuda_graph(t):
    """A GGUF embedding's rows decoded inside a captured CUDA graph, as a decode step's token lookup is: the replay
    gives the rows decoded eagerly (the capture fails on any host-to-device copy)."""
    block = GGML_QUANT_SIZES[t][0]
    w = as_gguf(random_blocks(t, 16, 2), t).to("cuda")
    ids = torch.tensor([3, 0, 7, 3], device="cuda")
    eager = w.take_rows(ids).dequantize(torch.float16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w.take_rows(ids).dequantize(torch.float16)
    graph.replay()
    torch.cuda.synchronize()
    assert out.shape == (4, 2 * block) and torch.equal(out.nan_to_num(), eager.nan_to_num())
