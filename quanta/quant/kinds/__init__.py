"""The canonical quantized kinds; importing this package registers every kind with QTensor."""
from quanta.quant.kinds.affine import Affine
from quanta.quant.kinds.codebook import FP4_TABLE, NF4_TABLE, Codebook
from quanta.quant.kinds.fp8 import Fp8

__all__ = ["Affine", "Codebook", "Fp8", "NF4_TABLE", "FP4_TABLE"]
