"""Writing K/V into the paged cache, and the FP8 (e4m3 / e5m2 stored as uint8) conversions.

    cache      [num_blocks, block_size, Hk, D]   model dtype, or uint8 fp8 codes
    k, v       [T, Hk, D]                        the step's new keys / values
    slot       [T] int64                          block_id * block_size + offset; < 0 skips the token
    scale      [Hk] float32                       fp8 only: stored code = fp8(x / scale)

The kernels write by bit operations (fp32_to_fp8_bits) and read as fp8_read_constexprs says. The torch path
(CPU, oracle) uses torch's own float8 casts; tests check the kernels agree with it bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from quanta.kernels.device_caps import device_caps
from quanta.kernels.triton_support import pdl_launch, pdl_launch_dependents, pdl_wait
from quanta.quant.errors import ConfigError
from quanta.quant.fp8_codes import FP8_FORMATS, Fp8Format, quantize


# kv_cache_dtype names (LLM, `quanta plan`) -> the FP8_FORMATS entry the cache stores in; "auto" is the model dtype.
KV_CACHE_DTYPES = {"auto": None, "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


@dataclass(frozen=True)
class KvFormat:
    """How the paged cache stores K and V: `name` as asked (a KV_CACHE_DTYPES key), `fp8` the format of its
    one-byte codes, None for elements in the model dtype. Parsed once, where a request is validated."""
    name: str
    fp8: Fp8Format | None

    @classmethod
    def parse(cls, kv_cache_dtype: str | KvFormat) -> KvFormat:
        """The KvFormat of a kv_cache_dtype name (or itself); ConfigError naming the known names."""
        if isinstance(kv_cache_dtype, KvFormat):
            return kv_cache_dtype
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
        fp8 = KV_CACHE_DTYPES[kv_cache_dtype]
        return cls(kv_cache_dtype, None if fp8 is None else FP8_FORMATS[fp8])

    def bytes_per_token(self, layers: int, kv_heads: int, head_dim: int, model_dtype_bytes: int) -> int:
        """Bytes of one token's K and V over `layers` layers: one byte an element in fp8, else the model
        dtype's size (the one element-size rule of the cache, its pool and the memory plan)."""
        element = 1 if self.fp8 is not None else model_dtype_bytes
        return 2 * layers * kv_heads * head_dim * element

    def __str__(self) -> str:
        return self.name


NO_FP8_WRITE = dict(FP8=0, FP8_MAX=0.0, FP8_SHIFT=0, FP8_REBIAS=0, FP8_MIN_NORMAL=0.0, FP8_MAGIC=0.0,
                    FP8_MAGIC_BITS=0)
NO_FP8_READ = dict(FP8=0, FP8_HW=False, FP8_UP_SHIFT=0, FP8_UP_MUL=1.0)
# fp8 -> fp16 in the attention kernels: None = by the sm89+ instruction where the device has it, else by bits;
# True / False force one way (tests and benchmarks compare the two; True fails to compile below sm89)
HARDWARE_FP8_READ: bool | None = None


def fp8_write_constexprs(fmt: Fp8Format | None) -> dict:
    """Kernel constexprs for writing a cache of format `fmt` (None: the model dtype, FP8=0)."""
    return NO_FP8_WRITE if fmt is None else fmt.write_constexprs()


def fp8_read_constexprs(fmt: Fp8Format | None, device: torch.device | str = "cpu") -> dict:
    """Kernel constexprs for reading a cache of format `fmt` (None: the model dtype, FP8=0) on `device`.

    Reading (the attention kernels) uses the conversion instruction on sm89+, and below it shifts the code into
    the fp16 bit pattern (fp8_bits_to_f16_pattern), the factor 2^(15 - bias) applied once per score / output."""
    if fmt is None:
        return NO_FP8_READ
    hardware = device_caps(device).fp8 if HARDWARE_FP8_READ is None else HARDWARE_FP8_READ
    return fmt.read_constexprs(hardware)


# --- torch path (CPU and oracle) ------------------------------------------------------------------
def reference_store(k, v, k_cache, v_cache, slot, k_scale=None, v_scale=None, fmt: Fp8Format | None = None):
    """What store() does, in torch: cache.view(-1, Hk, D)[slot] = (quantized) k, v for slot >= 0."""
    if bool((slot < 0).any()):               # padding rows (CUDA-graph batches) write nowhere
        keep = slot >= 0
        slot, k, v = slot[keep], k[keep], v[keep]
    if fmt is not None:
        k, v = quantize(k, k_scale, fmt), quantize(v, v_scale, fmt)
    k_cache.view(-1, *k_cache.shape[2:])[slot] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot] = v.to(v_cache.dtype)


# --- Triton bit-level conversions ---------------------------------------------------------------
@triton.jit
def fp32_to_fp8_bits(x, FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_REBIAS: tl.constexpr,
                     FP8_MIN_NORMAL: tl.constexpr, FP8_MAGIC: tl.constexpr, FP8_MAGIC_BITS: tl.constexpr):
    """fp32 -> uint8 fp8 code, round to nearest even, saturating at +-FP8_MAX.

    By bit operations only (no fp8 dtypes), so it runs on sm75/sm80 where Triton lacks `fp8e4nv`: it rounds
    through the fp32 bit pattern (normals) and a magic-number add (subnormals)."""
    x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    rounded = bits + ((1 << (FP8_SHIFT - 1)) - 1) + ((bits >> FP8_SHIFT) & 1)
    normal = (rounded >> FP8_SHIFT) - FP8_REBIAS
    subnormal = (a + FP8_MAGIC).to(tl.uint32, bitcast=True) - FP8_MAGIC_BITS
    code = tl.where(a < FP8_MIN_NORMAL, subnormal, normal)
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    return (code | sign).to(tl.uint8)


@triton.jit
def fp8_bits_to_f16_pattern(code, FP8_UP_SHIFT: tl.constexpr):
    """uint8 fp8 code -> the fp16 whose sign, exponent and mantissa bits are the code's: value / 2^(15-bias),
    exactly (fp16's wider exponent holds every fp8 value, subnormals included)."""
    b = code.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << FP8_UP_SHIFT)).to(tl.float16, bitcast=True)


@triton.jit
def head_scale(scale_ptr, head, mask, FP8: tl.constexpr):
    """The fp8 scale of kv head(s) `head` (where `mask`), or 1 for a cache in the model dtype (FP8 = 0)."""
    scale = 1.0
    if FP8 != 0:
        scale = tl.load(scale_ptr + head, mask=mask, other=1.0)
    return scale


@triton.jit
def to_cache_codes(x, scale, FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr,
                   FP8_REBIAS: tl.constexpr, FP8_MIN_NORMAL: tl.constexpr, FP8_MAGIC: tl.constexpr,
                   FP8_MAGIC_BITS: tl.constexpr):
    """x as a cache of this format holds it: the fp8 codes of x / scale, or x unchanged (FP8 = 0)."""
    if FP8 != 0:
        x = fp32_to_fp8_bits(x.to(tl.float32) / scale, FP8_MAX, FP8_SHIFT, FP8_REBIAS, FP8_MIN_NORMAL,
                             FP8_MAGIC, FP8_MAGIC_BITS)
    return x


@triton.jit
def _store_kernel(
    # pointers
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    # strides (elements): inputs per token / head; the cache is contiguous [slots, Hk, D]
    stride_kt, stride_kh, stride_vt, stride_vh,
    # constexpr meta
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_REBIAS: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_MAGIC: tl.constexpr, FP8_MAGIC_BITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """grid (T, Hk): one token's one kv head."""
    pdl_launch_dependents(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    # --- where the token goes
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (d < HEAD_DIM) & ((d * 0 + slot) >= 0)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    # --- load, (quantize), store
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
    k = to_cache_codes(k, head_scale(k_scale_ptr, h, True, FP8), FP8, FP8_MAX, FP8_SHIFT, FP8_REBIAS,
                       FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
    v = to_cache_codes(v, head_scale(v_scale_ptr, h, True, FP8), FP8, FP8_MAX, FP8_SHIFT, FP8_REBIAS,
                       FP8_MIN_NORMAL, FP8_MAGIC, FP8_MAGIC_BITS)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store(k, v, k_cache, v_cache, slot, k_scale=None, v_scale=None, fmt: Fp8Format | None = None) -> None:
    """Write k, v [T, Hk, D] at `slot` [T] into the caches (quantizing for fp8). Triton launch."""
    t, hk, d = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (hk, d)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and slot.shape == (t,)
    assert (fmt is None) == (k_cache.dtype != torch.uint8)
    if t == 0:
        return
    dummy = k_scale if k_scale is not None else slot
    _store_kernel[(t, hk)](k, v, k_cache, v_cache, slot, dummy, v_scale if v_scale is not None else dummy,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           NUM_KV_HEADS=hk, HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), **fp8_write_constexprs(fmt),
                           **pdl_launch(device_caps(k.device)))
