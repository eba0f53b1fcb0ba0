"""Device bytes of a model's weights per GPU, counted as quanta's kernels hold them, from a config alone:
per GEMM (gemm_bytes), per rank (weight_bytes, held_columns), at the height of the load (load_peak), and the
sizes a tensor-parallel split needs (size_problem).
"""
from __future__ import annotations

from dataclasses import dataclass

from quanta.kernels.affine.layout import R
from quanta.kernels.ggml.layout import LAYOUTS as GGML_LAYOUTS, held_block_bytes
from quanta.kernels.registry import CANDIDATES
from quanta.loaders.checkpoint import ModelConfig
from quanta.loaders.weight_format import WeightFormat
from quanta.quant.errors import ConfigError
from quanta.quant.ggml.types import GGML_TYPES_BY_NAME
from quanta.quant.kinds.gguf import CODEBOOK_TYPES
from quanta.quant.shard import widened_range

AFFINE_BITS = range(1, 9)                 # what the affine kernels pack: up to 4 bits in 4-bit fields, 5..8 in 8-bit
LUT_BYTES = 16 * 4 + 24 * 4               # codebook table: float32 [16] + its byte words int32 [24]
# GGUF types with an exact affine form (ggml.types' `affine`) run on the affine kernels, a group per ggml
# block; an integer zero packs as a symmetric scale, a float min as a zero point. The types the ggml kernels decode
# (K-quants, IQ4) run at their blocks' bytes. Other types are dequantized.
GGUF_ON_AFFINE_KERNELS = CANDIDATES[("gguf", "cuda")][0] == "quanta.kernels.affine"
GGUF_ON_GGML_KERNELS = "quanta.kernels.ggml_gemm" in CANDIDATES[("gguf", "cuda")]
# IQ4_NL and IQ4_XS run on the codebook kernels in fp16 (Gguf.to_codebook; bf16 keeps their blocks, the same bytes
# up to K's padding to a tile)
GGUF_ON_CODEBOOK_KERNELS = CODEBOOK_TYPES if "quanta.kernels.codebook_gemm" in CANDIDATES[("gguf", "cuda")] else ()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def packs(fmt: WeightFormat, k: int) -> bool:
    """Whether a GEMM of `fmt` with K = k runs on a packing kernel (else it is held dequantized)."""
    if fmt.kind == "affine":
        return fmt.bits in AFFINE_BITS and (fmt.group_size is None or fmt.group_size % R == 0)
    if fmt.kind == "codebook":
        return fmt.group_size % R == 0 and k % fmt.group_size == 0
    return fmt.kind == "fp8"


def pack_bytes(n: int, k: int, bits: int, group: int | None, symmetric: bool) -> int:
    """Bytes of the affine layout's state for codes [N, K]: int32 words [K_pad / (32 / bits), N] with K_pad = K
    rounded up to a tile of (32 / bits) * R columns, plus int32 scale words [rows, N]: rows = ceil(K_pad /
    group) with zero points (a (scale, zbias) pair a word: AWQ), or half that, rounded up, when symmetric
    (two scales a word: GPTQ sym, NF4's absmax, fp8's per-channel scale)."""
    per_word = 32 // (4 if bits <= 4 else 8)
    k_pad = cdiv(k, per_word * R) * per_word * R
    groups = cdiv(k_pad, group or k_pad)
    scale_rows = cdiv(groups, 2) if symmetric else groups
    return (k_pad // per_word) * n * 4 + scale_rows * n * 4


def gemm_bytes(fmt: WeightFormat, parts: list[tuple[int, str | None]], k: int, e: int) -> int:
    """Device bytes of one GEMM over input size k whose weight stacks `parts` [(N, GGML type or None)], as
    each kernel's prepare() stores a linear weight [N, K] (merged q/k/v and gate/up add up in N):
      dense (fp16 / bf16; fp32 checkpoints run in the 16-bit compute dtype): N*K*e bytes, e the compute
        dtype's size; the dequantized fallback (affine codes the kernels do not pack) holds the same;
      affine (AWQ, GPTQ; codebook and fp8 reuse its layout): pack_bytes;
      codebook (NF4): 4-bit codes, one 16-bit absmax per block of 64 (double quantization undone at load),
        and the 16-entry table as float32 [16] and byte words int32 [24] (AffineState.lut_bytes) per GEMM;
      fp8: one byte a weight, one scale per output channel (K_pad = K rounded to 64 in the weight-only
        layout; sm89's W8A8 holds the [K, N] bytes and float32 scales: the same for K a multiple of 64);
      GGUF: gguf_gemm_bytes."""
    n = sum(p for p, _ in parts)
    if fmt.kind == "gguf":
        return sum(gguf_gemm_bytes(p, k, t, e) for p, t in parts)
    if fmt.kind == "dense" or not packs(fmt, k):
        return n * k * e
    if fmt.kind == "affine":
        return pack_bytes(n, k, fmt.bits, fmt.group_size, fmt.symmetric)
    if fmt.kind == "codebook":
        return pack_bytes(n, k, 4, fmt.group_size, True) + LUT_BYTES
    return pack_bytes(n, k, 8, None, True)                      # fp8, per-channel


def gguf_gemm_bytes(n: int, k: int, ggml_type: str, e: int) -> int:
    """Device bytes of a GGUF weight [n, k]: the affine layout for the types with an affine form (IQ4's codebook
    form: that layout and a table), the blocks' own bytes for the types the ggml kernels decode (as they hold them:
    layout.held_block_bytes), else the dequantized 16-bit copy."""
    t = GGML_TYPES_BY_NAME[ggml_type]
    if k % t.block_size:
        return n * k * e
    if t.affine is not None and GGUF_ON_AFFINE_KERNELS:
        return pack_bytes(n, k, t.affine.bits, t.block_size, symmetric=t.affine.zero is not None)
    if t.name == "iq4_nl" and t.name in GGUF_ON_CODEBOOK_KERNELS:          # an fp16 scale a group of 32
        return pack_bytes(n, k, 4, t.block_size, True) + LUT_BYTES
    if t.name == "iq4_xs" and t.name in GGUF_ON_CODEBOOK_KERNELS:          # codes, a scale word a 128-column tile
        k_pad = cdiv(k, 128) * 128
        return n * (k_pad // 2 + k_pad // 32) + LUT_BYTES
    if t.name in GGML_LAYOUTS and GGUF_ON_GGML_KERNELS:
        return n * (k // t.block_size) * held_block_bytes(GGML_LAYOUTS[t.name])
    return n * k * e


@dataclass(frozen=True)
class Shard:
    """One rank's share of the model at tensor-parallel size tp."""
    tp: int
    q: int            # query width (heads * head_dim)
    kv: int           # key (= value) width
    kv_heads: int
    inter: int        # intermediate size
    vocab: int        # embedding / lm_head rows


def shard(config: ModelConfig, tp: int) -> Shard:
    """The per-rank sizes at tensor-parallel size tp (call check_tp first); KV heads are replicated when
    there are fewer than ranks, one per rank."""
    kv_heads = max(1, config.num_key_value_heads // tp)
    return Shard(tp, config.num_attention_heads // tp * config.head_dim, kv_heads * config.head_dim, kv_heads,
                 config.intermediate_size // tp, cdiv(config.vocab_size, tp))


def size_problem(config: ModelConfig, tp: int) -> str | None:
    """Why the model's sizes cannot be split over tp ranks, whatever its format, or None: attention heads,
    KV heads (split, or replicated evenly when fewer than ranks), intermediate size, and a vocabulary cut
    in pieces of cdiv(vocab, tp) rows that must leave the last rank some."""
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % tp:
        return f"{heads} attention heads do not split over {tp} ranks"
    if kv % tp and tp % kv:
        return f"{kv} KV heads neither split over {tp} ranks nor replicate evenly"
    if inter % tp:
        return f"intermediate size {inter} does not split over {tp} ranks"
    if (tp - 1) * cdiv(config.vocab_size, tp) >= config.vocab_size:
        return f"a vocabulary of {config.vocab_size} leaves rank {tp - 1} no rows"
    return None


@dataclass(frozen=True)
class WeightBytes:
    """Device bytes of one GPU's weights, by part."""
    embedding: int
    linears: int
    lm_head: int
    norms: int

    @property
    def total(self) -> int:
        return self.embedding + self.linears + self.lm_head + self.norms


def weight_bytes(config: ModelConfig, fmt: WeightFormat, s: Shard, e: int) -> WeightBytes:
    """Bytes one rank holds, e the compute dtype's size in bytes: its GEMMs (gemm_bytes), norms, and the
    embedding and lm_head, which stay 16-bit for awq / gptq / nf4 / fp8 as quantized checkpoints keep them,
    unless the checkpoint stores its lm_head quantized (fmt.lm_head_quantized: a GEMM of the format) (GGUF
    keeps its own types for the embedding, whose rows are decoded on lookup). A tied lm_head is loaded as a
    second device copy of the table, so it is counted twice."""
    h, layers, g = config.hidden_size, config.num_hidden_layers, fmt.gguf
    linears = 0
    for i in range(layers):
        t = (lambda role: g.of(role, i)) if g else (lambda role: None)
        linears += sum(held_bytes(fmt, s, roles, k, e, t) for roles, k in layer_gemms(s, h))
    if config.attention_bias:
        linears += layers * (s.q + 2 * s.kv) * e
    if g:
        embedding = s.vocab * GGML_TYPES_BY_NAME[g.of("token_embd")].row_bytes(h)
        lm_head = gemm_bytes(fmt, [(s.vocab, g.of("output"))], h, e)
    else:
        embedding = lm_head = s.vocab * h * e
        if fmt.lm_head_quantized:
            lm_head = gemm_bytes(fmt, [(s.vocab, None)], h, e)
    norms = (2 * layers + 1) * h * e + (2 * layers * config.head_dim * e if config.qk_norm else 0)
    return WeightBytes(embedding, linears, lm_head, norms)


def layer_gemms(s: Shard, h: int) -> tuple:
    """One decoder layer's GEMMs in load order, each ((role, N), ...) and its K, for one rank's shard."""
    return (((("attn_q", s.q), ("attn_k", s.kv), ("attn_v", s.kv)), h), ((("attn_output", h),), s.q),
            ((("ffn_gate", s.inter), ("ffn_up", s.inter)), h), ((("ffn_down", h),), s.inter))


def lora_slot_bytes(config: ModelConfig, s: Shard, max_loras: int, max_lora_rank: int, e: int) -> int:
    """Device bytes of the adapter slots (quanta.lora.slots): per slot and GEMM of every layer, A [P*R, K] and
    B [N, R] at the kernels' rank R (max_lora_rank rounded up to a power of two) and P float32 scales."""
    r = 1 << max(0, max_lora_rank - 1).bit_length()
    per_layer = sum(len(parts) * r * k * e + sum(n for _, n in parts) * r * e + 4 * len(parts)
                    for parts, k in layer_gemms(s, config.hidden_size))
    return max_loras * config.num_hidden_layers * per_layer


ROW_PARALLEL = ("attn_output", "ffn_down")


def held_columns(fmt: WeightFormat, s: Shard, role: str, k: int, gguf_type: str | None) -> int:
    """Input columns one rank holds of a GEMM whose share of K is `k`: a row-parallel piece is widened to whole
    groups or blocks where one straddles two ranks (shard.widened_cols), the widest rank's piece counted."""
    if s.tp == 1 or role not in ROW_PARALLEL or fmt.act_order and role == "attn_output":
        return k
    full = k * s.tp
    unit = fmt.k_block(gguf_type)
    return max(hi - lo for lo, hi in (widened_range(r * k, (r + 1) * k, full, unit) for r in range(s.tp)))


def held_bytes(fmt: WeightFormat, s: Shard, roles: tuple, k: int, e: int, t) -> int:
    """gemm_bytes of one GEMM of layer_gemms (`t`: role -> GGML type or None), over the columns a rank holds.
    Act-order (GPTQ desc_act) weights pack with their columns sorted by group; under tensor parallelism
    o_proj's piece of them (a contiguous range of attention-head columns) holds uneven groups, which the kernels
    do not take, so it is held dequantized. down_proj's groups are sorted before the cut (quant/group_sort.py):
    it stays packed."""
    if fmt.act_order and s.tp > 1 and roles[0][0] == "attn_output":
        return sum(n for _, n in roles) * k * e
    role = roles[0][0]
    return gemm_bytes(fmt, [(n, t(role)) for role, n in roles], held_columns(fmt, s, role, k, t(role)), e)


def canonical_bytes(fmt: WeightFormat, n: int, k: int, e: int, gguf_type: str | None = None) -> int:
    """Device bytes of a weight [n, k] in canonical form as a loader hands it to prepare: one byte per code
    (affine, codebook, fp8) with its 16-bit scales, zero points or absmax; GGUF blocks plus the one-byte
    codes of their affine form; dense weights at e bytes."""
    if fmt.kind == "dense" or (fmt.kind != "gguf" and not packs(fmt, k)):
        return n * k * e
    if fmt.kind == "gguf":
        return n * GGML_TYPES_BY_NAME[gguf_type].row_bytes(k) + n * k
    if fmt.kind == "affine":
        groups = cdiv(k, fmt.group_size or k)
        return n * k + n * groups * (2 if fmt.symmetric else 3)
    if fmt.kind == "codebook":
        return n * k + cdiv(n * k, fmt.group_size) * 4
    return n * k + n * 4                                          # fp8, per-channel float32 scales


def load_peak(config: ModelConfig, fmt: WeightFormat, s: Shard, e: int) -> int:
    """The most device memory one rank holds while loading, as model_loader loads: module by module in
    model order (embedding; per layer q/k/v, o_proj, gate/up, down_proj; lm_head), each module holding the
    weights loaded before it, its canonical parts (and, for a merged group, their stacked copy) and its
    final layout at once. Under tensor parallelism every part is read whole and then cut, so the whole
    parts are held beside the pieces (the lm_head's whole 128k-row table, read last, is the largest).
    The repack's own temporaries are bounded by layout.PACK_ROWS and left out; norms are too small to
    count. Dense parts are counted as if made on the device (an upper bound for host checkpoints, whose
    parts are stacked on the host)."""
    h, g = config.hidden_size, fmt.gguf
    whole = shard(config, 1)

    def table(sh: Shard) -> tuple[int, int]:
        if g:
            return (sh.vocab * GGML_TYPES_BY_NAME[g.of("token_embd")].row_bytes(h),
                    gemm_bytes(fmt, [(sh.vocab, g.of("output"))], h, e))
        return sh.vocab * h * e, sh.vocab * h * e
    embedding, lm_head = table(s)
    read_embedding, read_lm_head = table(whole) if s.tp > 1 else (0, 0)
    held = embedding
    peak = read_embedding + embedding
    for i in range(config.num_hidden_layers):
        t = (lambda role: g.of(role, i)) if g else (lambda role: None)
        for (roles, k), (whole_roles, whole_k) in zip(layer_gemms(s, h), layer_gemms(whole, h)):
            final = held_bytes(fmt, s, roles, k, e, t)
            canonical = sum(canonical_bytes(fmt, n, held_columns(fmt, s, role, k, t(role)), e, t(role))
                            for role, n in roles)
            read = sum(canonical_bytes(fmt, n, whole_k, e, t(role)) for role, n in whole_roles) if s.tp > 1 else 0
            # act-order: down_proj is read with gate/up, to sort its groups (quant/group_sort.py)
            ahead = canonical_bytes(fmt, h, whole.inter, e) if fmt.act_order and roles[0][0] == "ffn_gate" else 0
            peak = max(peak, held + read + canonical * (2 if len(roles) > 1 else 1) + final + ahead)
            held += final
    return max(peak, held + read_lm_head + lm_head)


def check_gguf_rows(config: ModelConfig, fmt: WeightFormat) -> None:
    """ConfigError if a GGUF type's blocks do not tile a weight's rows."""
    if not fmt.gguf:
        return
    rows = {"attn_output": config.num_attention_heads * config.head_dim, "ffn_down": config.intermediate_size}
    for role in fmt.gguf.roles():
        k = rows.get(role, config.hidden_size)
        for t in fmt.gguf.all_of(role):
            if k % GGML_TYPES_BY_NAME[t].block_size:
                raise ConfigError(f"{fmt.name}: {role} rows of {k} are not whole {t} blocks")
