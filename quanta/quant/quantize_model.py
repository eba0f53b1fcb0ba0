"""Quantize a whole checkpoint, layer by layer: the engine behind `quanta quantize`.

    spec = QuantSpec("gptq", bits=4, group_size=128, act_order=True)
    run = quantize_checkpoint(ckpt, spec, calibration=load_calibration(ckpt.tokenizer))
    for name, tensor in run:            # canonical names in model order; torch.Tensor or QTensor
        ...
    run.report                          # [ReportRow(name, scheme, weight_error, output_error)]
    run.kv_cache_scales                 # {"model.layers.{i}.self_attn.k_scale": float32 [], ...} (fp8 kv)
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from quanta.quant.calibration import CalibrationData, LayerRunner
from quanta.quant.codebook_quant import BLOCKSIZES, TABLES, quantize_4bit
from quanta.quant.errors import ConfigError
from quanta.quant.fp8_quant import STRATEGIES, amax_scale, fp8_weight
from quanta.quant.gptq import Hessian
from quanta.quant.layer_quant import LINEARS, awq_layer, fp8_layer, gptq_layer, gptq_weight
from quanta.quant.qtensor import QTensor
from quanta.quant.rtn import check_scheme, rtn_affine

METHODS = ("rtn", "awq", "gptq", "fp8", "nf4")
SCHEMES = ("int", "fp8")                     # the grid GPTQ rounds onto
LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(slots=True)
class QuantSpec:
    """What to produce. `symmetric` None means the method's usual choice (GPTQ: True, RTN/AWQ: False).

    Methods: "rtn" (Affine, AutoAWQ convention when asymmetric, GPTQ when symmetric), "awq", "gptq"
    (Affine; with scheme="fp8" GPTQ rounds onto the e4m3 grid instead: Fp8, dynamic activations),
    "fp8" (Fp8, dynamic activations unless fp8_activation="static"), "nf4" (Codebook, NF4 or FP4 by
    quant_type)."""
    method: str
    bits: int = 4
    group_size: int = 128
    symmetric: bool | None = None
    act_order: bool = False
    static_groups: bool = False
    damp: float = 0.01
    awq_clip: bool = True
    duo_scaling: bool = True
    fp8_strategy: str = "channel"
    fp8_activation: str = "dynamic"          # "dynamic" | "static"
    kv_cache_scales: bool = False            # fp8: calibrate per-layer k_scale / v_scale
    quant_type: str = "nf4"                  # nf4 method: "nf4" | "fp4"
    blocksize: int = 64
    double_quant: bool = False
    quantize_lm_head: bool = False
    scheme: str = "int"                      # gptq: "int" (bits, group_size, symmetric) or "fp8" (fp8_strategy)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ConfigError(f"quantize: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.symmetric is None:
            self.symmetric = self.method == "gptq"
        if self.scheme not in SCHEMES or self.scheme == "fp8" and self.method != "gptq":
            raise ConfigError(f"quantize: scheme must be one of {SCHEMES}, 'fp8' with method gptq only "
                              f"(plain FP8 is method 'fp8'); got {self.scheme!r} for {self.method}")
        affine = self.method in ("rtn", "awq", "gptq") and self.scheme == "int"
        if affine and (not isinstance(self.bits, int) or not 2 <= self.bits <= 8):
            raise ConfigError(f"quantize: {self.method} bits must be an integer 2..8, got {self.bits!r}")
        if (self.act_order or self.static_groups) and self.method != "gptq":
            raise ConfigError(f"quantize: act_order / static_groups are GPTQ options, not {self.method}")
        if self.method == "gptq" and not 0 < self.damp < 1:
            raise ConfigError(f"quantize: gptq damp must be in (0, 1), got {self.damp!r}")
        if self.method == "fp8" or self.scheme == "fp8":
            if self.fp8_strategy not in STRATEGIES:
                raise ConfigError(f"quantize: fp8_strategy must be one of {STRATEGIES}, got {self.fp8_strategy!r}")
            if self.fp8_activation not in ("dynamic", "static"):
                raise ConfigError(f"quantize: fp8_activation must be 'dynamic' or 'static', got {self.fp8_activation!r}")
        if self.method != "fp8" and (self.fp8_activation != "dynamic" or self.kv_cache_scales):
            why = " (GPTQ-FP8 has dynamic activations)" if self.scheme == "fp8" else ""
            raise ConfigError(f"quantize: fp8_activation / kv_cache_scales are options of method fp8, "
                              f"not {self.method}{why}")
        if self.method == "nf4" and (self.quant_type not in TABLES or self.blocksize not in BLOCKSIZES):
            raise ConfigError(f"quantize: nf4 needs quant_type in {tuple(TABLES)} and blocksize in {BLOCKSIZES}, "
                              f"got {self.quant_type!r} and {self.blocksize!r}")

    @property
    def needs_calibration(self) -> bool:
        return self.method in ("awq", "gptq") or (self.method == "fp8" and (
            self.fp8_activation == "static" or self.kv_cache_scales))


@dataclass
class ReportRow:
    """One quantized weight (or, with scheme "layer", one decoder layer's output) and its errors."""
    name: str
    scheme: str
    weight_error: float | None       # ||W - Ŵ|| / ||W||
    output_error: float | None       # ||XWᵀ - XŴᵀ|| / ||XWᵀ|| on calibration inputs (layer: of its update)


def linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of every linear of a decoder layer, from the config alone."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}


def as_float(t) -> torch.Tensor:
    """A tensor or QTensor as float32 (a quantized weight dequantized)."""
    return t.dequantize(torch.float32) if isinstance(t, QTensor) else t.float()


def names_by_layer(names: list[str]) -> dict[int, list[str]]:
    """The decoder layers' tensor names, by layer index, in the order given."""
    by_layer: dict[int, list[str]] = {}
    for name in names:
        if m := LAYER_NAME.fullmatch(name):
            by_layer.setdefault(int(m.group(1)), []).append(name)
    return by_layer


def model_order(name: str) -> tuple[int, int]:
    """Sort key of a canonical tensor name in model order: the embedding, then layer by layer, then the rest
    (final norm, lm_head)."""
    m = LAYER_NAME.fullmatch(name)
    if name == "model.embed_tokens.weight":
        return (0, 0)
    return (1, int(m.group(1))) if m else (2, 0)


class QuantizeRun:
    """The iterator `quantize_checkpoint` returns; `report` and `kv_cache_scales` fill as it runs.

    rtn, nf4 and weight-only fp8 never run the model. The others run it in float32 one decoder layer at a time
    (quant/calibration.py), quantize that layer's linears, and feed the quantized layer's output to the next.
    The work runs on `device`: one layer's weights and the calibration activations live there, and every result
    comes back to the CPU as it is yielded.
    Embeddings, norms and lm_head stay in full precision (lm_head is quantized with the same scheme when
    `quantize_lm_head`, by RTN for AWQ)."""

    def __init__(self, ckpt, spec: QuantSpec, calibration: CalibrationData | None, quiet: bool,
                 device: torch.device | str = "cpu"):
        self.ckpt, self.spec, self.calibration, self.quiet = ckpt, spec, calibration, quiet
        self.device = torch.device(device)
        self.report: list[ReportRow] = []
        self.kv_cache_scales: dict[str, torch.Tensor] = {}
        cfg = ckpt.config
        names = list(ckpt.tensors)
        if spec.needs_calibration and calibration is None:
            raise ConfigError(f"quantize: {spec.method} needs calibration data (see load_calibration)")
        if spec.quantize_lm_head and "lm_head.weight" not in names:
            raise ConfigError("quantize: quantize_lm_head was asked for, but the checkpoint has no lm_head.weight "
                              "(tie_word_embeddings: lm_head is the embedding)")
        shapes = {f"model.layers.{i}.{n}.weight": s for i in range(cfg.num_hidden_layers)
                  for n, s in linear_shapes(cfg).items()}
        missing = [n for n in shapes if n not in set(names)]
        if missing:
            raise ConfigError(f"quantize: {ckpt.path}: no tensor {missing[0]} (and {len(missing) - 1} more)")
        if spec.quantize_lm_head:
            shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        if spec.method in ("rtn", "awq", "gptq") and spec.scheme == "int":
            for name, shape in shapes.items():
                check_scheme(name, shape, spec.bits, spec.group_size)
        self.targets = set(shapes)
        self.names = sorted(names, key=model_order)

    def _report(self, name: str, q, w: torch.Tensor, out_err: float | None):
        """Record q's errors against w (both on the run's device); q moved to the CPU, to be yielded."""
        werr = float((q.dequantize() - w).norm() / w.norm().clamp(min=1e-12))
        self.report.append(ReportRow(name, q.describe(), werr, out_err))
        return q.to("cpu")

    def _weight(self, t) -> torch.Tensor:
        """A checkpoint tensor as float32 on the run's device (moved in its stored form, then widened there)."""
        return as_float(t.to(self.device))

    def _weight_only(self, name: str, w: torch.Tensor):
        spec = self.spec
        if spec.method == "nf4":
            return quantize_4bit(w, spec.quant_type, spec.blocksize, spec.double_quant, name=name)
        if spec.method == "fp8":
            return fp8_weight(w, spec.fp8_strategy, name=name)
        return rtn_affine(w, spec.bits, spec.group_size, spec.symmetric, name=name)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
        from tqdm import tqdm

        tensors = self.ckpt.tensors
        if not self.spec.needs_calibration:
            for name in tqdm(self.names, desc=f"quantize {self.spec.method}", disable=self.quiet):
                t = tensors[name]
                if name in self.targets:
                    w = self._weight(t)
                    yield name, self._report(name, self._weight_only(name, w), w, None)
                else:
                    yield name, self._passthrough(t)
            return
        yield from self._calibrated(tensors)

    def _passthrough(self, t):
        return (t.dequantize(self.ckpt.config.torch_dtype) if isinstance(t, QTensor) else t).to("cpu")

    def _calibrated(self, tensors):
        from tqdm import tqdm

        cfg, spec = self.ckpt.config, self.spec
        runner = LayerRunner(cfg, device=self.device)
        by_layer = names_by_layer(self.names)
        embed = tensors["model.embed_tokens.weight"]
        x = as_float(embed)[self.calibration.tokens].to(self.device)
        yield "model.embed_tokens.weight", self._passthrough(embed)
        for i in tqdm(range(cfg.num_hidden_layers), desc=f"quantize {spec.method}", disable=self.quiet):
            names = by_layer.get(i, [])
            originals = {n: tensors[n] for n in names}
            weights = {LAYER_NAME.fullmatch(n).group(2): self._weight(t) for n, t in originals.items()}
            layer = runner.build(i, weights)
            method = {"awq": awq_layer, "gptq": gptq_layer, "fp8": fp8_layer}[spec.method]
            quantized, float_out, errors, *extra = method(runner, layer, x, spec)
            if spec.method == "fp8":
                for k, amax in extra[0].items():
                    self.kv_cache_scales[f"model.layers.{i}.self_attn.{k}_scale"] = amax_scale(amax)
            x_next = extra[0] if spec.method == "gptq" else runner.forward(layer, x)
            m = float_out.shape[0]          # gptq measures the float output on the first samples only
            err = float((x_next[:m] - float_out).norm() / (float_out - x[:m]).norm().clamp(min=1e-12))
            state = layer.state_dict()
            for n in names:
                rel = LAYER_NAME.fullmatch(n).group(2)
                linear = rel.removesuffix(".weight")
                if linear in quantized and rel.endswith(".weight"):
                    yield n, self._report(n, quantized[linear], weights[rel], errors.get(linear))
                elif rel in state and not torch.equal(state[rel], weights[rel]):     # AWQ-folded norm / bias
                    yield n, state[rel].to("cpu", originals[n].dtype if isinstance(originals[n], torch.Tensor)
                                           else cfg.torch_dtype)
                else:
                    yield n, self._passthrough(originals[n])
            self.report.append(ReportRow(f"model.layers.{i}", "layer", None, err))
            x = x_next
            del layer, state, weights, originals
        for name in self.names:
            if model_order(name)[0] == 2:
                if name == "lm_head.weight" and spec.quantize_lm_head:
                    yield name, self._lm_head(tensors, name, x)
                else:
                    yield name, self._passthrough(tensors[name])

    def _lm_head(self, tensors, name: str, x: torch.Tensor):
        """lm_head quantized with the spec; GPTQ and static FP8 see the final-norm hidden states."""
        spec, w = self.spec, self._weight(tensors[name])
        norm = self._weight(tensors["model.norm.weight"])
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.ckpt.config.rms_norm_eps) * norm
        if spec.method == "gptq":
            hess = Hessian(w.shape[1], h.device)
            for c in range(0, h.shape[0], 8):
                hess.add_batch(h[c:c + 8])
            q = gptq_weight(w, hess, spec, name)
        elif spec.method == "fp8":
            static = amax_scale(h.abs().max()) if spec.fp8_activation == "static" else None
            q = fp8_weight(w, spec.fp8_strategy, static, name=name)
        else:
            q = rtn_affine(w, spec.bits, spec.group_size, spec.symmetric, convention="awq", name=name)
        return self._report(name, q, w, None)


def quantize_checkpoint(ckpt, spec: QuantSpec, calibration: CalibrationData | None = None,
                        quiet: bool = False, device: torch.device | str | None = None) -> QuantizeRun:
    """Check `spec` against `ckpt` now and return the run to iterate: every option and every linear's shape is
    checked before any work (ConfigError / UnsupportedError naming tensor and value). `device`: where the
    layers are quantized (quantize_device: None takes the GPU when there is one)."""
    return QuantizeRun(ckpt, spec, calibration, quiet, quantize_device(device))


def quantize_device(device: torch.device | str | None) -> torch.device:
    """The device to quantize on: None or "auto" the first CUDA GPU where there is one, else the CPU; a named
    device checked now (ConfigError for a GPU that is not there)."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"quantize: device must be auto, cpu or cuda[:N], got {device!r}") from e
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"quantize: device must be auto, cpu or cuda[:N], got {str(device)!r}")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ConfigError(f"quantize: device {str(device)!r} is not available "
                          f"({torch.cuda.device_count()} CUDA devices here)")
    return device


__all__ = ["QuantSpec", "QuantizeRun", "ReportRow", "quantize_checkpoint", "quantize_device", "LINEARS"]
