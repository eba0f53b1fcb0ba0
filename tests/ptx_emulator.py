"""A NumPy emulator of the few PTX instructions quanta's inline assembly uses, so that Triton's interpreter
(which refuses inline assembly) can run those kernels on the CPU in tests.

Semantics follow the PTX ISA: registers hold 32-bit patterns (a 64-bit operand, which `mov.b64 {lo, hi}` splits,
64); `lop3.b32` applies its 8-bit truth table (ta = 0xF0, tb = 0xCC, tc = 0xAA); `shf.l.wrap.b32` is the upper word
of {b, a} shifted left by c mod 32 (a rotation when a = b); `prmt.b32` picks (or sign-replicates) bytes of {b, a};
`dp4a.u32.s32` adds the dot of a's unsigned bytes and b's signed ones to c (`dp4a.s32.s32`: both signed);
`.f16x2` arithmetic works on the two halves, `fma.rn` rounding the exact a*b + c once, `mul.rn` a*b, `add.rn` a + b
and `sub.rn` a - b once to fp16 (float64 holds a*b exactly, and a*b + c so closely that its one rounding to fp16 is
the right one; numpy rounds float64 to fp16 directly, to nearest even), `fma.rn.bf16x2` the same to bf16;
`cvt.f32.f16` widens, `add.f32` / `mul.f32` / `fma.rn.f32` work in float32; `%laneid` reads 0 (the interpreter runs
a program as one thread). Anything else raises, so a kernel using a new instruction fails loudly.
"""
from __future__ import annotations

import re

import numpy as np


def _bits(x: np.ndarray) -> np.ndarray:
    """An operand's register bits: 32-bit values as uint32 patterns, 64-bit ones (constraint l) as uint64."""
    if x.dtype.itemsize == 8:
        return x.view(np.uint64)
    return x.view(np.uint32) if x.dtype.itemsize == 4 else x.astype(np.uint32)


def _signed(v: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned `bits`-bit values (int64) as the signed values of the same bits."""
    return v - ((v & (1 << bits - 1)) << 1)


def _halves(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = (bits & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (bits >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
    return lo, hi


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    lo16 = lo.astype(np.float16).view(np.uint16).astype(np.uint32)
    hi16 = hi.astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo16 | (hi16 << 16)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    out = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            term = (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
            out |= term
    return out


def _prmt(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """prmt.b32 (generic mode): byte i of the result is byte (c's nibble i & 7) of {b, a} (a = bytes 0-3),
    or, when the nibble's bit 3 is set, that byte's sign bit replicated over the byte."""
    src = (a.astype(np.uint64) | (b.astype(np.uint64) << 32))
    out = np.zeros_like(a)
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = ((src >> ((sel & 7) * 8).astype(np.uint64)) & 0xFF).astype(np.uint32)
        byte = np.where(sel & 8, np.where(byte & 0x80, 0xFF, 0), byte).astype(np.uint32)
        out |= byte << (8 * i)
    return out


def _bf16_halves(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    lo = ((bits & 0xFFFF) << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = (bits & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    return lo, hi


def _bf16_round(v: np.ndarray) -> np.ndarray:
    """float64 values (exact products and sums of bf16, which float32 holds) -> bf16 patterns, to nearest even."""
    b = v.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint32) & 0xFFFF


def run(asm: str, inputs: list[np.ndarray], outputs: int = 1) -> np.ndarray | list[np.ndarray]:
    """Execute `asm` ($0.. the outputs, then the inputs, as 32-bit patterns); returns $0's 32-bit patterns, or a list
    of the `outputs` first registers' when more than one."""
    shape = np.broadcast_shapes(*(x.shape for x in inputs))
    regs: dict[str, np.ndarray] = {f"${i + outputs}": np.broadcast_to(_bits(x), shape).copy()
                                   for i, x in enumerate(inputs)}

    def val(tok: str) -> np.ndarray:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return np.full(shape, int(tok, 0) & 0xFFFFFFFF, dtype=np.uint32)

    for stmt in asm.replace("{\n", "\n").rstrip().rstrip("}").split(";"):
        stmt = stmt.strip().strip("{").strip()
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if m := re.fullmatch(r"\{\s*([\w$]+)\s*,\s*([\w$]+)\s*\}\s*,\s*(\S+)", rest):      # mov.b32 {lo, hi}, r
            src, half = val(m.group(3)).astype(np.uint64), 32 if op == "mov.b64" else 16
            lo, hi = src & ((1 << half) - 1), src >> half
            regs[m.group(1)], regs[m.group(2)] = lo.astype(np.uint32), hi.astype(np.uint32)
            continue
        dst, *args = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            regs[dst] = val(args[0]).copy()
        elif op == "mov.u32" and args == ["%laneid"]:    # the interpreter runs a program as one thread: lane 0
            regs[dst] = np.zeros(shape, dtype=np.uint32)
        elif op == "lop3.b32":
            regs[dst] = _lop3(val(args[0]), val(args[1]), val(args[2]), int(args[3], 0))
        elif op == "shr.u32":
            regs[dst] = val(args[0]) >> val(args[1])
        elif op == "shl.b32":
            regs[dst] = (val(args[0]).astype(np.uint64) << val(args[1]).astype(np.uint64)).astype(np.uint32)
        elif op == "shf.l.wrap.b32":
            a, b, c = (val(x).astype(np.uint64) for x in args)
            regs[dst] = ((((b << 32) | a) << (c & 31)) >> 32).astype(np.uint32)
        elif op in ("dp4a.u32.s32", "dp4a.s32.s32"):     # c + the bytes of a (unsigned or signed) times b's signed
            a, b, c = (val(x).astype(np.int64) for x in args)
            total = _signed(c, 32)
            for i in range(4):
                ab = (a >> 8 * i) & 0xFF
                total = total + (ab if op == "dp4a.u32.s32" else _signed(ab, 8)) * _signed((b >> 8 * i) & 0xFF, 8)
            regs[dst] = (total & 0xFFFFFFFF).astype(np.uint32)
        elif op == "or.b32":
            regs[dst] = val(args[0]) | val(args[1])
        elif op == "and.b32":
            regs[dst] = val(args[0]) & val(args[1])
        elif op == "prmt.b32":
            regs[dst] = _prmt(val(args[0]), val(args[1]), val(args[2]))
        elif op == "fma.rn.f16x2":
            (a0, a1), (b0, b1), (c0, c1) = (_halves(val(x)) for x in args)
            regs[dst] = _pack(a0 * b0 + c0, a1 * b1 + c1)
        elif op == "add.rn.f16x2":
            (a0, a1), (b0, b1) = (_halves(val(x)) for x in args)
            regs[dst] = _pack(a0 + b0, a1 + b1)
        elif op == "sub.rn.f16x2":
            (a0, a1), (b0, b1) = (_halves(val(x)) for x in args)
            regs[dst] = _pack(a0 - b0, a1 - b1)
        elif op == "mul.rn.f16x2":
            (a0, a1), (b0, b1) = (_halves(val(x)) for x in args)
            regs[dst] = _pack(a0 * b0, a1 * b1)
        elif op == "fma.rn.bf16x2":                      # float32 holds a bf16 product exactly; one rounding
            (a0, a1), (b0, b1), (c0, c1) = (_bf16_halves(val(x)) for x in args)
            regs[dst] = _bf16_round(a0 * b0 + c0) | (_bf16_round(a1 * b1 + c1) << 16)
        elif op == "cvt.f32.f16":
            regs[dst] = (val(args[0]) & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
        elif op == "add.f32":
            regs[dst] = (val(args[0]).view(np.float32) + val(args[1]).view(np.float32)).view(np.uint32)
        elif op == "mul.f32":
            regs[dst] = (val(args[0]).view(np.float32) * val(args[1]).view(np.float32)).view(np.uint32)
        elif op == "fma.rn.f32":                         # one rounding of the exact a*b + c (float64 holds it)
            a, b, c = (val(x).view(np.float32).astype(np.float64) for x in args)
            regs[dst] = (a * b + c).astype(np.float32).view(np.uint32)
        else:
            raise NotImplementedError(f"PTX emulator: {op}")
    return regs["$0"] if outputs == 1 else [regs[f"${i}"] for i in range(outputs)]


def install(monkeypatch) -> None:
    """Make Triton's interpreter run inline assembly through `run` (pytest's monkeypatch undoes it)."""
    from triton.runtime import interpreter

    class _Call:
        def __init__(self, results):
            self.results = results

        def get_result(self, i):
            return self.results[i]

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        assert pack in (1, 2), "the emulator runs one or two elements per instance"
        scalars = [getattr(ty, "element_ty", ty) for ty in types]
        if pack == 1:
            operands, shape = [v.data for v in values], None
        else:
            # pack 2: the pairs are neighbours along the last dimension (the kernels put that dimension in
            # consecutive registers); a 32-bit input is two operands, a 16-bit one a single packed operand
            shape = np.broadcast_shapes(*(v.data.shape for v in values))
            operands = []
            for v in values:
                a = np.broadcast_to(v.data, shape)
                lo, hi = a[..., 0::2], a[..., 1::2]
                if a.dtype.itemsize == 4:
                    operands += [lo.view(np.uint32), hi.view(np.uint32)]
                else:
                    operands.append(lo.view(np.uint16).astype(np.uint32)
                                    | (hi.view(np.uint16).astype(np.uint32) << 16))
        outs = run(asm, operands, len(types))
        results = []
        for out, scalar in zip(outs if len(types) > 1 else [outs], scalars):
            if pack == 1:
                if scalar.is_fp16():                     # a 16-bit output (constraint h): the low half
                    bits = (out & 0xFFFF).astype(np.uint16).view(np.float16)
                else:
                    bits = out.view(np.float32) if scalar.is_fp32() else out.view(np.int32)
                results.append(interpreter.TensorHandle(bits, scalar))
                continue
            assert scalar.is_fp16() or scalar.is_bf16(), "pack 2 emulates 16-bit float outputs"
            halves = np.stack([out & 0xFFFF, out >> 16], axis=-1).reshape(shape).astype(np.uint16)
            results.append(interpreter.TensorHandle(halves.view(np.float16) if scalar.is_fp16() else halves, scalar))
        return _Call(results)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm)
