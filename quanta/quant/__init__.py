"""What a quantized weight means: canonical kinds, QTensor, reference (de)quantization. No I/O."""
from quanta.quant.errors import ConfigError, CorruptFileError, QuantaError, ShapeError, UnsupportedError
from quanta.quant.qtensor import QTensor
from quanta.quant.kinds import Affine, Codebook, Fp8, Gguf

__all__ = ["QTensor", "Affine", "Codebook", "Fp8", "Gguf", "QuantaError", "CorruptFileError",
           "UnsupportedError", "ConfigError", "ShapeError"]
