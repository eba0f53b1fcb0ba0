"""One decoder layer's calibrated quantization: AWQ, GPTQ and FP8 static / KV-cache observation.

    awq_layer(runner, layer, x, spec)  -> (quantized, float_out, errors)   layer's norms/linears re-scaled
    gptq_layer(runner, layer, x, spec) -> (quantized, float_out, errors, output)
    fp8_layer(runner, layer, x, spec)  -> (quantized, float_out, errors, kv_amax)

`quantized` maps linear names relative to the layer ("self_attn.q_proj") to QTensors; `float_out` is
the unquantized layer's output on x; `errors` the relative output error of each linear on its
calibration inputs. Afterwards the layer holds the dequantized weights, so `runner.forward(layer, x)`
gives the quantized layer's output, which feeds the next layer (as AutoAWQ and GPTQ do).
"""
from __future__ import annotations

import importlib

import torch

from quanta.quant.awq_search import clip_weight, fold_scale_into_linear, fold_scale_into_norm, search_clip, search_scale
from quanta.quant.fp8_quant import AmaxObserver, fp8_weight
from quanta.quant.gptq import Hessian, gptq_fp8, gptq_quantize
from quanta.quant.rtn import rtn_affine

SEQUENTIAL = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
              ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
LINEARS = tuple(n for group in SEQUENTIAL for n in group)
INPUT_OF = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
            "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
            "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}


def _set(layer, name: str, w: torch.Tensor) -> None:
    layer.get_submodule(name).weight.data = w.float()


def _out_error(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    x = x.reshape(-1, x.shape[-1])
    ref = x @ w.T
    return float((x @ wq.T - ref).norm() / ref.norm().clamp(min=1e-12))


def _capture_inputs(runner, layer, x):
    """The calibration inputs of every distinct linear input, and the layer's output."""
    feats = {n: [] for n in set(INPUT_OF.values())}
    out = runner.capture(layer, x, {n: feats[n].append for n in feats})
    return {n: torch.cat(v) for n, v in feats.items()}, out


@torch.no_grad()
def awq_layer(runner, layer, x: torch.Tensor, spec):
    """AWQ of one layer; modifies the layer's norms and linears in place.

    It follows AutoAWQ: all four scale searches run on the unmodified layer (q/k/v against the
    attention, o_proj only when v_proj and o_proj have the same shape, gate/up against the MLP,
    down_proj alone), then every scale is folded in and the cached inputs divided by it, then clipping
    is searched for every linear but q/k, then RTN in AutoAWQ's convention."""
    feats, float_out = _capture_inputs(runner, layer, x)
    attn, mlp = layer.self_attn, layer.mlp
    plan = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj",
             runner.attention(layer))]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:
        plan.append((attn.v_proj, [attn.o_proj], "self_attn.o_proj", attn.o_proj))
    plan += [(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj", mlp),
             (mlp.up_proj, [mlp.down_proj], "mlp.down_proj", mlp.down_proj)]
    scales = [search_scale(feats[inp], fcs, fwd, spec.bits, spec.group_size, spec.symmetric,
                           duo_scaling=spec.duo_scaling) for _, fcs, inp, fwd in plan]
    for (prev, fcs, inp, _), s in zip(plan, scales):
        if isinstance(prev, torch.nn.Linear):
            fold_scale_into_linear(prev, fcs, s)
        else:
            fold_scale_into_norm(prev.weight, fcs, s)
        feats[inp] = feats[inp] / s.view(1, 1, -1)
    quantized, errors = {}, {}
    for name in LINEARS:
        w = layer.get_submodule(name).weight.data.clone()
        x_in = feats[INPUT_OF[name]]
        if spec.awq_clip and name not in ("self_attn.q_proj", "self_attn.k_proj"):
            w = clip_weight(w, search_clip(w, x_in, spec.bits, spec.group_size, spec.symmetric))
        quantized[name] = rtn_affine(w, spec.bits, spec.group_size, spec.symmetric, convention="awq", name=name)
        wq = quantized[name].dequantize()
        errors[name] = _out_error(layer.get_submodule(name).weight.data, wq, x_in)
        _set(layer, name, wq)
    return quantized, float_out, errors


class _Stop(Exception):
    """Raised by a pre-hook once the input it waits for is captured: the rest of the forward is skipped."""


def _input_of(module: torch.nn.Module, run, xs: list[torch.Tensor]) -> torch.Tensor:
    """The input `module` receives when `run(chunk)` runs on each chunk of xs, stopping right there."""
    seen = []

    def hook(_, args):
        seen.append(args[0])
        raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        for chunk in xs:
            try:
                run(chunk)
            except _Stop:
                pass
    finally:
        handle.remove()
    return torch.cat(seen)


def gptq_weight(w: torch.Tensor, hessian: Hessian, spec, name: str):
    """GPTQ of one weight onto the spec's grid: an Affine (scheme "int") or an Fp8 (scheme "fp8")."""
    if spec.scheme == "fp8":
        return gptq_fp8(w, hessian, spec.fp8_strategy, spec.act_order, spec.damp, name=name)[0]
    return gptq_quantize(w, hessian, spec.bits, spec.group_size, spec.symmetric, spec.act_order,
                         spec.static_groups, spec.damp, name=name)[0]


def _gptq_group(layer, names, inputs: list[torch.Tensor], spec, quantized, errors) -> None:
    """GPTQ of the linears `names`, which all read `inputs` (chunks); weights replaced by their dequantized form."""
    # one for the group: gptq_quantize does not modify it
    hessian = Hessian(inputs[0].shape[-1], inputs[0].device)
    for chunk in inputs:
        hessian.add_batch(chunk)
    for name in names:
        w = layer.get_submodule(name).weight.data
        q = gptq_weight(w, hessian, spec, name)
        wq = q.dequantize()
        d, H = wq - w, hessian.H
        errors[name] = float(((d @ H * d).sum() / (w @ H * w).sum().clamp(min=1e-30)).clamp(min=0).sqrt())
        quantized[name] = q
        _set(layer, name, wq)


@torch.no_grad()
def gptq_layer(runner, layer, x: torch.Tensor, spec):
    """GPTQ of one layer, group by group: (quantized, float_out, errors, output).

    "True sequential": q/k/v, then o, then gate/up, then down (SEQUENTIAL), each group's Hessians collected
    with the earlier groups already quantized.
    Each group's inputs are computed once, from the previous stage with the earlier groups already
    quantized, stopping the forward at the group's input: norm -> q/k/v, attention -> o, residual +
    norm -> gate/up, activation -> down, residual -> the quantized layer's `output` (so no separate
    forward is needed). `float_out` is the unquantized layer's output on the first chunk of samples
    only (for the error report).
    """
    quantized, errors = {}, {}
    c = runner.chunk
    float_out = runner.forward(layer, x[:c])
    xs = list(x.split(c))
    attn, mlp = layer.self_attn, layer.mlp
    xn = [layer.input_layernorm(chunk) for chunk in xs]
    _gptq_group(layer, SEQUENTIAL[0], xn, spec, quantized, errors)
    o_in = _input_of(attn.o_proj, runner.attention(layer), xn).split(c)
    del xn
    _gptq_group(layer, SEQUENTIAL[1], o_in, spec, quantized, errors)
    h = [chunk + attn.o_proj(o) for chunk, o in zip(xs, o_in)]
    del o_in
    hn = [layer.post_attention_layernorm(chunk) for chunk in h]
    _gptq_group(layer, SEQUENTIAL[2], hn, spec, quantized, errors)
    down_in = _input_of(mlp.down_proj, mlp, hn).split(c)
    del hn
    _gptq_group(layer, SEQUENTIAL[3], down_in, spec, quantized, errors)
    out = torch.cat([chunk + mlp.down_proj(d) for chunk, d in zip(h, down_in)])
    return quantized, float_out, errors, out


@torch.no_grad()
def fp8_layer(runner, layer, x: torch.Tensor, spec):
    """FP8 weights of one layer with static input scales and/or the layer's k/v amax (for kv scales)."""
    observers = {n: AmaxObserver() for n in set(INPUT_OF.values())}
    kv = {"k": AmaxObserver(), "v": AmaxObserver()}
    attn = layer.self_attn
    module = importlib.import_module(type(layer).__module__)
    cos, sin = runner.position_embeddings(x.shape[1], x)

    def keys(k):        # what the cache stores: k_proj output, k_norm (Qwen3), then rotary
        k = k.view(*k.shape[:-1], -1, runner.cfg.head_dim)
        if hasattr(attn, "k_norm"):
            k = attn.k_norm(k)
        k = k.transpose(1, 2)
        kv["k"].observe(module.apply_rotary_pos_emb(k, k, cos, sin)[1])

    float_out = runner.capture(layer, x, {n: o.observe for n, o in observers.items()},
                               {"self_attn.k_proj": keys, "self_attn.v_proj": kv["v"].observe})
    quantized, errors = {}, {}
    for name in LINEARS:
        w = layer.get_submodule(name).weight.data
        input_scale = observers[INPUT_OF[name]].scale() if spec.fp8_activation == "static" else None
        quantized[name] = fp8_weight(w, spec.fp8_strategy, input_scale, name=name)
        _set(layer, name, quantized[name].dequantize())
    return quantized, float_out, errors, {"k": kv["k"].amax, "v": kv["v"].amax}
