"""What a quantized weight means: canonical kinds, QTensor, reference (de)quantization. No I/O.

The errors import at once; QTensor and the kinds load torch, so they are imported when first asked for (the
command line answers --help and bad flags without torch)."""
from quanta.quant.errors import ConfigError, CorruptFileError, QuantaError, ShapeError, UnsupportedError

_LAZY = {"QTensor": "quanta.quant.qtensor", "Affine": "quanta.quant.kinds", "Codebook": "quanta.quant.kinds",
         "Fp8": "quanta.quant.kinds", "Gguf": "quanta.quant.kinds"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = ["QTensor", "Affine", "Codebook", "Fp8", "Gguf", "QuantaError", "CorruptFileError",
           "UnsupportedError", "ConfigError", "ShapeError"]
