"""The canonical quantized kinds; importing this package registers every kind with QTensor."""
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.codebook import FP4_TABLE, NF4_TABLE, Codebook
from quanta.quant.kinds.fp8 import Fp8
from quanta.quant.kinds.gguf import Gguf

__all__ = ["Affine", "Codebook", "Fp8", "Gguf", "NF4_TABLE", "FP4_TABLE"]
