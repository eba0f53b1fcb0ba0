"""What `quanta quantize` was asked for, resolved to a method, a scheme and an output format, and every
check that can fail made before any weight is touched.

    opts = QuantizeOptions.resolve("gptq", bits=4, group_size=128, act_order=True, ...)   # option errors
    opts = QuantizeOptions.resolve("gptq", scheme="fp8")     # GPTQ onto the FP8 e4m3 grid
    opts.check_model(ckpt)            # the scheme against every linear, the format's writer against it
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quanta.loaders.formats import quantize_formats
from quanta.quant.errors import ConfigError

METHODS = ("rtn", "awq", "gptq", "fp8", "nf4", "gguf")
SCHEMES = ("int", "fp8")              # the grid gptq rounds onto
AFFINE = ("rtn", "awq", "gptq")
CALIBRATED = ("awq", "gptq")
DEFAULT_SAMPLES, DEFAULT_SEQLEN = 32, 512


def _check_lm_head(name: str, method: str, scheme: str, format: str) -> None:
    """ConfigError unless the lm_head can be quantized with the method and written in `format`: an integer
    scheme, into a format whose config declares a quantized lm_head (GPTQ's `lm_head`)."""
    from quanta.loaders.formats import get, resolve
    if method not in AFFINE or scheme != "int":
        raise ConfigError(f"{name}: lm_head quantization is for the integer schemes of rtn, awq and gptq")
    layout = get(format).layout
    if layout is None or "lm_head.weight" in resolve(layout).float_only:
        raise ConfigError(f"{name}: the {format} format keeps the lm_head in float; a quantized lm_head is written "
                          "in the gptq format (format='gptq')")


@dataclass(slots=True)
class QuantizeOptions:
    """A checked request: method, scheme, output format, calibration.

    The output formats of a method are the format table's rows that hold its output (formats.
    quantize_formats); without `format`, AWQ's is written for asymmetric 4-bit integers, GPTQ's for other
    integers, compressed-tensors for fp8 (and GPTQ with scheme "fp8", act-order by default), bitsandbytes for
    nf4, GGUF for gguf. Whether a format can hold the scheme is decided by the format's own writer: a sample
    weight of the scheme, of each distinct linear shape, goes through the writer's layout (format_check.py)."""
    method: str
    format: str
    bits: int | None
    group_size: int | None
    symmetric: bool | None
    act_order: bool
    type: str | None
    calibration: Path | None          # None: the method runs without calibration data
    n_samples: int
    seqlen: int
    imatrix: bool | Path              # True: collected from the calibration text; a Path: llama.cpp's file
    scheme: str = "int"               # gptq: "int" or "fp8"
    lm_head: bool = False             # the lm_head quantized too (integer schemes, formats that declare it)

    @classmethod
    def resolve(cls, method: str, *, bits=None, group_size=None, symmetric=None, act_order=None, type=None,
                format=None, calibration=None, n_samples=None, seqlen=None, imatrix=False,
                scheme=None, lm_head=False) -> QuantizeOptions:
        """Defaults filled in per method; ConfigError naming the option for anything that cannot apply."""
        if method not in METHODS:
            raise ConfigError(f"quantize: method must be one of {', '.join(METHODS)}, got {method!r}")
        name = f"quantize --method {method}"
        scheme = "int" if scheme is None else scheme
        if act_order is None:             # on for FP8 (as llm-compressor's GPTQ): per-channel scales make it free
            act_order = scheme == "fp8"
        if scheme not in SCHEMES or scheme == "fp8" and method != "gptq":
            raise ConfigError(f"{name}: scheme must be one of {', '.join(SCHEMES)}, and fp8 goes with --method gptq "
                              f"only (plain round-to-nearest FP8 is --method fp8); got {scheme!r}")
        if scheme == "fp8":
            if bits not in (None, 8) or group_size is not None or symmetric is not None:
                raise ConfigError(f"{name} --scheme fp8: e4m3 per channel has no bits, group_size or --sym/--asym "
                                  f"to choose; got bits={bits!r}, group_size={group_size!r}, symmetric={symmetric!r}")
        elif method in AFFINE:
            bits = 4 if bits is None else bits
            group_size = 128 if group_size is None else group_size
            if not isinstance(bits, int) or not 2 <= bits <= 8:
                raise ConfigError(f"{name}: bits must be an integer 2..8, got {bits!r}")
            if symmetric is None:
                symmetric = method == "gptq"
        else:
            if method == "fp8" and bits not in (None, 8) or method == "nf4" and bits not in (None, 4):
                raise ConfigError(f"{name}: the bit width is fixed ({'8' if method == 'fp8' else '4'}); "
                                  f"got bits={bits!r}")
            if method == "gguf" and bits is not None:
                raise ConfigError(f"{name}: the GGUF type sets the bits; pass type (e.g. Q4_K_M), not bits={bits!r}")
            if symmetric is not None:
                raise ConfigError(f"{name}: --sym/--asym apply to rtn, awq and gptq only")
            if group_size is not None and method != "nf4":
                raise ConfigError(f"{name}: group_size applies to rtn, awq, gptq and nf4 (its blocksize) only")
        if act_order and method != "gptq":
            raise ConfigError(f"{name}: act_order is a GPTQ option (use --method gptq)")
        if (type is None) != (method != "gguf"):
            raise ConfigError(f"{name}: " + ("pass a GGUF type, e.g. type='Q4_K_M'" if method == "gguf"
                                             else f"type={type!r} is for --method gguf only"))
        if imatrix is not False and imatrix is not None and method != "gguf":
            raise ConfigError(f"{name}: imatrix is a GGUF option (AWQ and GPTQ always use calibration data)")
        if isinstance(imatrix, (str, Path)):
            imatrix = Path(imatrix)
            if not imatrix.is_file():
                raise ConfigError(f"{name}: imatrix file {imatrix} does not exist (pass llama-imatrix's output, "
                                  f"or imatrix=True to collect one from the calibration text)")
        elif imatrix not in (True, False, None):
            raise ConfigError(f"{name}: imatrix must be True, False or a file path, got {imatrix!r}")
        imatrix = bool(imatrix) if not isinstance(imatrix, Path) else imatrix
        formats = ("compressed-tensors",) if scheme == "fp8" else quantize_formats(method)
        if format is None:
            format = formats[0] if scheme == "fp8" else _default_format(method, bits, symmetric, act_order)
        if format not in formats:
            raise ConfigError(f"{name}: cannot write format {format!r}; this method writes {', '.join(formats)}"
                              + (" with --scheme fp8" if scheme == "fp8" else ""))
        if lm_head:
            _check_lm_head(name, method, scheme, format)
        uses_data = method in CALIBRATED or imatrix is True
        if calibration is not None and not uses_data:
            raise ConfigError(f"{name}: calibration data is used by awq, gptq and gguf with imatrix only"
                              + (" (an imatrix file replaces it)" if isinstance(imatrix, Path) else ""))
        if uses_data:
            from quanta.quant.calibration import DEFAULT_TEXT
            calibration = Path(calibration) if calibration is not None else DEFAULT_TEXT
            if not calibration.is_file():
                raise ConfigError(f"calibration text {calibration} does not exist (pass a UTF-8 text file)")
        n_samples = DEFAULT_SAMPLES if n_samples is None else n_samples
        seqlen = DEFAULT_SEQLEN if seqlen is None else seqlen
        if not isinstance(n_samples, int) or n_samples <= 0 or not isinstance(seqlen, int) or seqlen <= 1:
            raise ConfigError(f"{name}: n_samples must be > 0 and seqlen > 1, got {n_samples!r} and {seqlen!r}")
        return cls(method, format, bits, group_size, symmetric, act_order, type, calibration if uses_data else None,
                   n_samples, seqlen, imatrix, scheme, bool(lm_head))

    @property
    def affine(self) -> bool:
        """Whether the method produces integer (Affine) weights."""
        return self.method in AFFINE and self.scheme == "int"

    def spec(self):
        """The QuantSpec of quant/quantize_model.py for the affine, fp8 and nf4 methods."""
        from quanta.quant.quantize_model import QuantSpec

        if self.scheme == "fp8":
            return QuantSpec("gptq", scheme="fp8", act_order=self.act_order)
        if self.method in AFFINE:
            return QuantSpec(self.method, bits=self.bits, group_size=self.group_size, symmetric=self.symmetric,
                             act_order=self.act_order, quantize_lm_head=self.lm_head)
        if self.method == "nf4":
            return QuantSpec("nf4", blocksize=64 if self.group_size is None else self.group_size)
        return QuantSpec(self.method)

    def describe(self) -> str:
        """The scheme in a few words, e.g. "gptq w4g128 sym act-order -> gptq"."""
        if self.affine:
            group = "pc" if self.group_size in (-1, 0) else f"g{self.group_size}"
            scheme = f"w{self.bits}{group} {'sym' if self.symmetric else 'asym'}" + \
                     (" act-order" if self.act_order else "") + (" lm_head" if self.lm_head else "")
        elif self.method == "gguf":
            scheme = self.type.upper() + (" imatrix" if self.imatrix else "")
        elif self.method == "nf4":
            scheme = f"blocksize {64 if self.group_size is None else self.group_size}"
        else:
            scheme = "fp8 " * (self.method == "gptq") + "e4m3 per-channel, dynamic activations" + \
                     (" act-order" if self.act_order else "")
        return f"{self.method} {scheme} -> {self.format}"


def _default_format(method: str, bits, symmetric, act_order) -> str:
    """The format a method writes unless told: AWQ's for asymmetric 4-bit integers, GPTQ's for other integers,
    else the first format that holds the method's output."""
    if method in AFFINE:
        return "awq" if bits == 4 and not symmetric else "gptq"
    return quantize_formats(method)[0]
