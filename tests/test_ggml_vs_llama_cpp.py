"""`quanta quantize --method gguf` against llama.cpp's own `llama_model_quantize` on the same float32 GGUF, of the
default model and of a second one whose rows are whole K-quant blocks: every tensor's type and bytes identical, for
the K-quant types and the mixes, with and without an importance matrix (an llama-imatrix file for quanta, the same
weights through llama_model_quantize_params.imatrix for llama.cpp). Needs llama-cpp-python (its bundled libllama);
skipped where it is not installed."""
from __future__ import annotations

import numpy as np
import pytest

import quanta

pytestmark = pytest.mark.slow            # quantizes the 135M model several times on two cores
llama_cpp = pytest.importorskip("llama_cpp")

# llama_ftype of each mix / type (llama.h). The default model's rows of 576 are not whole 256-wide K-quant blocks:
# the mixes fall back per tensor as llama-quantize does, while a plain K type is refused (quantize's own check).
FTYPES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q4_0": 2, "Q5_1": 9, "Q8_0": 7, "IQ4_NL": 25,
          "IQ4_XS": 30}


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory, default_model_path):
    """The default model as one float32 GGUF file, the input both quantizers read."""
    out = tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf"
    quanta.convert(default_model_path, "gguf:F32", out, validate=False, quiet=True)
    return out


def tensors(path) -> dict[str, tuple[int, bytes]]:
    from gguf import GGUFReader
    return {t.name: (int(t.tensor_type), np.asarray(t.data).tobytes()) for t in GGUFReader(path).tensors}


@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", list(FTYPES))
def test_every_tensor_is_byte_identical_with_llama_quantize(name, with_imatrix, f32_gguf, tmp_path):
    assert_identical(f32_gguf, name, FTYPES[name], with_imatrix, tmp_path)


# A second model whose rows are whole 256-element blocks, so the mixes run their K-quant types rather than the
# default model's fallbacks: QUANTA_PARITY_MODEL names a checkpoint (benchmarks/train_second_model.py's), else the
# test writes a random one with heavy-tailed rows and four query heads a KV head (Q2_K's attn_v rule).
# llama_ftype 18 is LLAMA_FTYPE_MOSTLY_Q6_K, 25 IQ4_NL, 30 IQ4_XS.
SECOND_FTYPES = {"Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30}


def random_f32_gguf(path, n_layer: int = 4, d: int = 256, ff: int = 768, vocab: int = 512) -> None:
    """A llama-architecture float32 GGUF written with the gguf package: random weights, some rows heavy-tailed or
    scaled up, as trained weights have them."""
    import gguf
    rng = np.random.default_rng(7)

    def mat(n, k):
        x = rng.standard_normal((n, k)).astype(np.float32) * np.float32(0.02)
        x[::7] = rng.standard_t(3, (len(x[::7]), k)).astype(np.float32) * np.float32(0.01)
        x[::11] *= np.float32(20.0)
        return x

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(n_layer), w.add_context_length(2048), w.add_embedding_length(d)
    w.add_feed_forward_length(ff), w.add_head_count(8), w.add_head_count_kv(2), w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5), w.add_file_type(0), w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2"), w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab), w.add_token_merges([])
    w.add_tensor("token_embd.weight", mat(vocab, d))
    for i in range(n_layer):
        shapes = {"attn_q": (d, d), "attn_k": (d // 4, d), "attn_v": (d // 4, d), "attn_output": (d, d),
                  "ffn_gate": (ff, d), "ffn_up": (ff, d), "ffn_down": (d, ff)}
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{i}.{name}.weight", mat(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", mat(vocab, d))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def imatrix_sums(path) -> dict[str, tuple[np.ndarray, int]]:
    """Random llama-imatrix statistics for every matrix of GGUF `path`: sums of x^2 over `count` rows, log-normal
    across columns (a few columns dominate, as real activations' do)."""
    from gguf import GGUFReader
    rng = np.random.default_rng(11)
    out = {}
    for t in GGUFReader(path).tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            count = int(rng.integers(1000, 5000))
            out[t.name] = ((rng.lognormal(0.0, 2.0, int(t.shape[0])) * count).astype(np.float32), count)
    return out


def write_imatrix_gguf(path, sums: dict[str, tuple[np.ndarray, int]]) -> None:
    """The GGUF layout llama-imatrix writes: `<name>.in_sum2` and `<name>.counts` (F32) per tensor."""
    import gguf
    w = gguf.GGUFWriter(str(path), "imatrix")
    w.add_array("imatrix.datasets", ["random"]), w.add_uint32("imatrix.chunk_count", 8)
    w.add_uint32("imatrix.chunk_size", 512)
    for name, (s, count) in sums.items():
        w.add_tensor(f"{name}.in_sum2", s)
        w.add_tensor(f"{name}.counts", np.array([count], np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def llama_imatrix(sums: dict[str, tuple[np.ndarray, int]]):
    """llama-quantize's hand-over of an imatrix (tools/quantize: in_sum2 / count in float32) as the C array
    llama_model_quantize_params.imatrix points to, NULL-terminated; the arrays kept alive with it."""
    import ctypes
    keep = [(name.encode(), np.ascontiguousarray(s / np.float32(count))) for name, (s, count) in sums.items()]
    entries = (llama_cpp.llama_model_imatrix_data * (len(keep) + 1))()
    for e, (name, v) in zip(entries, keep):
        e.name, e.size = name, v.size
        e.data = v.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    return entries, keep


@pytest.fixture(scope="module")
def second_f32(tmp_path_factory):
    import os
    out = tmp_path_factory.mktemp("second") / "second-f32.gguf"
    if os.environ.get("QUANTA_PARITY_MODEL"):
        quanta.convert(os.environ["QUANTA_PARITY_MODEL"], "gguf:F32", out, validate=False, quiet=True)
    else:
        random_f32_gguf(out)
    return out


@pytest.mark.parametrize("with_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("name", list(SECOND_FTYPES))
def test_second_model_byte_identical_with_llama_quantize(name, with_imatrix, second_f32, tmp_path):
    a = assert_identical(second_f32, name, SECOND_FTYPES[name], with_imatrix, tmp_path)
    assert {t for t, _ in a.values()} & {10, 11, 12, 13, 14, 23}, "no K type ran: rows not whole 256-blocks"


def assert_identical(src, name: str, ftype: int, with_imatrix: bool, tmp_path) -> dict:
    """quanta's `name` of float32 GGUF `src` against llama_model_quantize's `ftype`: every tensor's type and bytes;
    with an imatrix (random statistics, written as llama-imatrix's GGUF for quanta and handed to llama.cpp as
    llama-quantize hands it over) also that llama.cpp's output changed with it (Q8_0 takes none). Returns
    llama.cpp's tensors."""
    theirs, ours = tmp_path / "llama.gguf", tmp_path / "quanta.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    kwargs = {}
    if with_imatrix:
        sums = imatrix_sums(src)
        write_imatrix_gguf(tmp_path / "imatrix.gguf", sums)
        entries, _keep = llama_imatrix(sums)
        params.imatrix = entries
        kwargs["imatrix"] = tmp_path / "imatrix.gguf"
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(theirs).encode(), params) == 0
    quanta.quantize(src, ours, "gguf", type=name, quiet=True, **kwargs)
    a, b = tensors(theirs), tensors(ours)
    assert set(a) == set(b)
    wrong_type = sorted(n for n in a if a[n][0] != b[n][0])
    differ = sorted(n for n in a if a[n] != b[n])
    assert wrong_type == [] and differ == [], f"{name}: types differ in {wrong_type}, bytes in {len(differ)}: {differ}"
    if with_imatrix and name != "Q8_0":           # Q8_0 rounds to nearest: no imatrix reaches it
        params.imatrix = None
        assert llama_cpp.llama_model_quantize(str(src).encode(), str(tmp_path / "plain.gguf").encode(), params) == 0
        changed = tensors(tmp_path / "plain.gguf") != a
        assert changed, "the imatrix changed nothing in llama.cpp's output"
    return a
