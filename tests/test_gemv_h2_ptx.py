"""gemv_h2's inline PTX (the Q4_K, Q5_K and Q6_K dot products, the strings the kernels pass to inline_asm_elementwise)
run instruction by instruction by tests/ptx_emulator.py, as CI has no GPU: one-hot activations read back the value
the asm gives every code of a super-block, which must be the `gguf` package's dequantization of the same bytes at
d = 1, unit scales and zero mins, over 16 (the kernel's scale-up); random activations give dot products within fp16
accumulation of float64; a mutated copy of each string must fail; and the whole kernels, PTX included, run in the
interpreter against the dequantized weight."""
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from kernel_util import DEVICE, TOL, rel_err  # noqa: I001  (sets TRITON_INTERPRET)
import ptx_emulator
from quanta.kernels import ggml_gemm
from quanta.kernels.ggml import gemv_cols, gemv_h2
from test_ggml_gemm import make_gguf

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="a GPU runs the real PTX (test_ggml_gemm.py -m gpu)")

ASM = {"Q4_K": gemv_h2._Q4K_DOT.value, "Q5_K": gemv_h2._Q5K_DOT.value, "Q6_K": gemv_h2._Q6K_DOT.value}
OUTPUTS = {"Q4_K": 2, "Q5_K": 2, "Q6_K": 4}
# byte ranges of a block's fields (ggml-common.h): the fp16 d / dmin, the scales, the code fields (low bits first)
FIELDS = {"Q4_K": {"d": 0, "dmin": 2, "scales": (4, 16), "codes": ((16, 144),)},
          "Q5_K": {"d": 0, "dmin": 2, "scales": (4, 16), "codes": ((48, 176), (16, 48))},
          "Q6_K": {"d": 208, "scales": (192, 208), "codes": ((0, 128), (128, 192))}}
# unit scales: Q4_K / Q5_K's six-bit scales 1 and mins 0 (get_scale_min_k4's packing), Q6_K's int8 scales 1
UNIT_SCALES = {"Q4_K": [1] * 4 + [0] * 4 + [0x01] * 4, "Q5_K": [1] * 4 + [0] * 4 + [0x01] * 4, "Q6_K": [1] * 16}
# bit patterns of the code fields (low bits, then Q5_K's / Q6_K's high bits): random, all zero, all set, mixed
PATTERNS = {"Q4_K": [("random",), ("zero",), ("ones",)]}
PATTERNS["Q5_K"] = PATTERNS["Q6_K"] = [("random", "random"), ("zero", "zero"), ("ones", "ones"), ("random", "zero"),
                                       ("random", "ones"), ("zero", "ones")]


def unit_blocks(name: str, pattern: tuple[str, ...], n: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, type_size]: blocks at d = 1 (dmin 0) and unit scales whose code fields follow `pattern`."""
    size = GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    f = FIELDS[name]
    raw[:, f["d"]:f["d"] + 2] = np.array([1.0], np.float16).view(np.uint8)
    if "dmin" in f:
        raw[:, f["dmin"]:f["dmin"] + 2] = 0
    raw[:, f["scales"][0]:f["scales"][1]] = UNIT_SCALES[name]
    for (lo, hi), fill in zip(f["codes"], pattern):
        if fill != "random":
            raw[:, lo:hi] = 0xFF if fill == "ones" else 0
    return raw


def words(raw: np.ndarray, field: tuple[int, int]) -> np.ndarray:
    """A block field's little-endian 32-bit words: uint32 [n, bytes / 4]."""
    return np.ascontiguousarray(raw[:, field[0]:field[1]]).view("<u4")


def calls(name: str, raw: np.ndarray):
    """The asm calls of blocks `raw` [n] as the kernel makes them: per call its code-word operands (uint32 [n]
    each) and its activation pairs as (value of the low half, value of the high half, output they sum into)."""
    f = FIELDS[name]
    if name == "Q6_K":
        ql, qh = words(raw, f["codes"][0]), words(raw, f["codes"][1])
        for h in range(2):                                 # 128-value half; word column i = 2g + c
            for g in range(4):
                cols = [2 * g + c for c in range(2)]
                ops = [w for i in cols for w in (ql[:, 16 * h + i], ql[:, 16 * h + 8 + i], qh[:, 8 * h + i])]
                # quarter q of column i: values 128h + 32q + 4i + e; pairs (e = 0, 2), (1, 3)
                pairs = [(128 * h + 32 * q + 4 * i + e, 128 * h + 32 * q + 4 * i + e + 2, q)
                         for i in cols for q in range(4) for e in range(2)]
                yield ops, pairs
        return
    qs = words(raw, f["codes"][0])
    for j in range(4):                                     # 64-value chunk: sub-blocks 2j (low), 2j + 1 (high)
        for g in range(2):                                 # words 4g + c of the chunk
            ops = [qs[:, 8 * j + 4 * g + c] for c in range(4)]
            if name == "Q5_K":                             # qh words 4g + c (shared by the chunks), the rotation
                ops += [words(raw, f["codes"][1])[:, 4 * g + c] for c in range(4)]
                ops.append(np.full(len(raw), (4 - 2 * j) & 31, np.uint32))
            base = [64 * j + 16 * g + 4 * c for c in range(4)]
            pairs = [(b + 32 * s + e, b + 32 * s + e + 2, s) for b in base for s in range(2) for e in range(2)]
            yield ops, pairs


def emulate(name: str, asm: str, raw: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The asm's float32 outputs on every call of blocks `raw` [n] with fp16 activations x [n, X, 256] (X activation
    vectors a block): [n, X, calls, outputs], and each output's value indices [calls, outputs, values]."""
    bits = x.view(np.uint16).astype(np.uint32)
    outs, owners = [], []
    for ops, pairs in calls(name, raw):
        pair_ops = [bits[..., lo] | (bits[..., hi] << 16) for lo, hi, _ in pairs]
        out = ptx_emulator.run(asm, [op[:, None] for op in ops] + pair_ops, OUTPUTS[name])
        outs.append(np.stack([o.view(np.float32) for o in out], axis=-1))
        owners.append([[v for lo, hi, o in pairs if o == out_i for v in (lo, hi)] for out_i in range(OUTPUTS[name])])
    return np.stack(outs, axis=2), np.array(owners)


def code_mismatches(name: str, asm: str, raw: np.ndarray) -> int:
    """Values of blocks `raw` whose one-hot activation does not read back exactly gguf's dequantization / 16 at its
    own output (and 0 at every other output of every call)."""
    ref = quants.dequantize(raw, GGMLQuantizationType[name]).reshape(len(raw), 256) / 16.0
    x = np.broadcast_to(np.eye(256, dtype=np.float16), (len(raw), 256, 256))
    got, owners = emulate(name, asm, raw, x)
    want = np.zeros_like(got)
    for call, per_out in enumerate(owners):
        for out, values in enumerate(per_out):
            want[:, values, call, out] = ref[:, values]
    return int((got != want).any(axis=(2, 3)).sum())


@pytest.mark.parametrize("name", list(ASM))
def test_the_calls_cover_each_value_of_a_super_block_once(name):
    """The wiring the tests copy from the kernel: every value of the block in exactly one pair lane of one call."""
    _, owners = emulate(name, ASM[name], unit_blocks(name, PATTERNS[name][0], 1), np.zeros((1, 1, 256), np.float16))
    assert sorted(owners.ravel().tolist()) == list(range(256))


@pytest.mark.parametrize("name,pattern", [(n, p) for n in ASM for p in PATTERNS[n]], ids=str)
def test_ptx_codes_match_the_gguf_dequantization(name, pattern):
    """Each value's code as the PTX forms it from the words (nibbles, Q5_K's fifth bits, Q6_K's 2-bit fields, the
    centre of 32 subtracted) is gguf's at d = 1 and unit scales, on every chunk, word, byte and nibble."""
    assert code_mismatches(name, ASM[name], unit_blocks(name, pattern, 4, seed=len(pattern))) == 0


@pytest.mark.parametrize("name", list(ASM))
def test_ptx_dot_products_match_float64(name):
    """Random codes and N(0, 1) activations: each output within the fp16 accumulation bound of the float64 dot
    product. A lane rounds once a product, k products a lane (Q4_K / Q5_K: 4 words x 2 pairs; Q6_K: 2 columns x 2),
    so |error| <= k 2**-11 sum |terms|."""
    raw = unit_blocks(name, PATTERNS[name][0], 6, seed=5)
    codes = quants.dequantize(raw, GGMLQuantizationType[name]).reshape(len(raw), 256) / 16.0
    x = np.random.default_rng(7).standard_normal((len(raw), 3, 256)).astype(np.float16)
    got, owners = emulate(name, ASM[name], raw, x)
    terms = (codes[:, None, :] * x.astype(np.float64))[:, :, owners]       # [blocks, x, calls, outputs, values]
    k = 8 if name != "Q6_K" else 4
    bound = k * 2.0 ** -11 * np.abs(terms).sum(axis=-1) + 2.0 ** -24
    assert (np.abs(got - terms.sum(axis=-1)) <= bound).all(), np.abs(got - terms.sum(axis=-1)).max()


# one-instruction edits of the asm (at the first place the text occurs): a shift amount, a LOP3 mask or truth
# table, a constant
MUTANTS = {"Q4_K": [("shr.u32 t, $2, 8;", "shr.u32 t, $2, 4;"), ("0x000F000F", "0x000F0007"),
                    ("0x00F000F0, 0x64006400, 0xEA", "0x00F000F0, 0x64006400, 0xE8")],
           "Q5_K": [("shl.b32 u, q, 3;", "shl.b32 u, q, 2;"), ("shr.u32 v, q, 5;", "shr.u32 v, q, 6;"),
                    ("0x01000100, 0x64006400", "0x01000000, 0x64006400")],
           "Q6_K": [("shl.b32 h2, $6, 2;", "shl.b32 h2, $6, 3;"), ("shr.u32 s2, $6, 6;", "shr.u32 s2, $6, 4;"),
                    ("0xD420D420", "0xD440D440"), ("0x03000300, q3", "0x03000100, q3")]}


@pytest.mark.parametrize("name,old,new", [(n, *m) for n in MUTANTS for m in MUTANTS[n]], ids=str)
def test_a_mutated_asm_fails_the_code_check(name, old, new):
    """The check catches a one-instruction slip: each edit of the real string makes some codes differ."""
    assert old in ASM[name], old
    assert code_mismatches(name, ASM[name].replace(old, new, 1), unit_blocks(name, PATTERNS[name][0], 2)) > 0


def test_an_unknown_instruction_raises():
    """An instruction the emulator does not know fails loudly instead of passing as a no-op."""
    asm = ASM["Q4_K"].replace("shr.u32 t, $2, 8;", "bfe.u32 t, $2, 8, 8;")
    with pytest.raises(NotImplementedError, match="bfe.u32"):
        code_mismatches("Q4_K", asm, unit_blocks("Q4_K", ("random",), 1))


@pytest.mark.parametrize("name", list(ASM))
def test_kernel_with_emulated_ptx_matches_the_gguf_dequantization(name, monkeypatch):
    """The whole GEMV (gemv_cols) with its PTX in the interpreter, the asm run by the emulator, two rows split over
    K: the operands the kernel passes, its scales and mins, against gguf's dequantization and the float32 twin."""
    ptx_emulator.install(monkeypatch)
    w, ref = make_gguf(40, 512, name, seed=4)
    st = ggml_gemm.prepare(w, DEVICE, torch.float16)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(8)).half()
    y = gemv_cols.matmul(x, st, None, (16, 4, 64.0, 1), ptx=True)
    twin = gemv_cols.matmul(x, st, None, (16, 4, 64.0, 1), ptx=False)
    assert rel_err(y, x.double() @ ref.double().T) < TOL[torch.float16]
    assert rel_err(y, twin) < 2e-3
