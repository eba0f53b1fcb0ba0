"""The activation peak of one engine step, as the memory plan counts it before anything runs."""
from __future__ import annotations

from quanta.kernels.affine.plan import CUBLAS_MIN_M as AFFINE_CUBLAS_MIN_M
from quanta.kernels.ggml.plan import LOWEST_CUBLAS_MIN_M as GGML_CUBLAS_MIN_M
from quanta.loaders.checkpoint import ModelConfig

# the fewest rows from which some quantized path dequantizes a weight for cuBLAS (affine or ggml, any type)
DEQUANT_MIN_M = min(AFFINE_CUBLAS_MIN_M, GGML_CUBLAS_MIN_M)
LOGIT_ROW_COPIES = 4                 # float32 [rows, vocab] alive in sampling: logits, probs, noise, probs/noise


def activation_peak(config: ModelConfig, q: int, kv: int, inter: int, tokens: int, rows: int, e: int,
                    dequantized: bool) -> int:
    """Peak activation bytes of one step of `tokens` tokens sampling `rows` rows (one rank's widths q, kv,
    inter; e the compute dtype's size), as ModelRunner.profile_peak_memory measures it:

        peak = 3*T*h*e + max(attention, mlp, logits)
        attention = max(T*qkv*e + D(qkv, h), T*(qkv + 2q)*e, T*q*e + D(h, q) + T*h*e)
        mlp       = max(T*2I*e + D(2I, h), T*3I*e, T*I*e + D(h, I) + T*h*e)
        logits    = 4 * rows * vocab * 4

    T tokens, h hidden, qkv = q + 2kv, I intermediate; 3*T*h*e: the residual stream, the layer input and
    its normed copy. The attention terms: the merged qkv output, then it with the rotated q and the
    attention output, then o_proj's. The MLP terms: gate_up's output, then it with its SiLU-and-mul
    product, then down_proj's. D(N, K) = N*K*e is the dequantized copy of a quantized weight
    (dequantize + cuBLAS from DEQUANT_MIN_M rows), 0 for 16-bit weights. Sampling holds four float32
    [rows, vocab] tensors (logits, probabilities, the exponential noise and their quotient)."""
    h, qkv = config.hidden_size, q + 2 * kv
    t = tokens

    def d(n: int, k: int) -> int:
        return n * k * e if dequantized and t >= DEQUANT_MIN_M else 0

    attention = max(t * qkv * e + d(qkv, h), t * (qkv + 2 * q) * e, t * q * e + d(h, q) + t * h * e)
    mlp = max(t * 2 * inter * e + d(2 * inter, h), t * 3 * inter * e, t * inter * e + d(h, inter) + t * h * e)
    logits = LOGIT_ROW_COPIES * rows * config.vocab_size * 4
    return 3 * t * h * e + max(attention, mlp, logits)
