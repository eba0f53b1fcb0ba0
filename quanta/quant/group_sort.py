"""Act-order down_proj groups made contiguous by renumbering the MLP's intermediate features.

The renumbering is exact, nothing requantized; `sort_mlp` says why it holds and why it matters.
"""
from __future__ import annotations

import dataclasses

import torch

from quanta.quant.kinds import Affine


def declares_act_order(quant_config: dict | None) -> bool:
    """Whether a checkpoint's quantization config says its weights may carry act-order groups (GPTQ
    desc_act, compressed-tensors actorder, a synthetic `...act` format): the loader then reads each
    down_proj with its gate/up, which other checkpoints are spared."""
    def walk(node) -> bool:
        if isinstance(node, dict):
            return any((key in ("desc_act", "actorder") and value not in (None, False, "static"))
                       or walk(value) for key, value in node.items())
        return isinstance(node, list) and any(walk(v) for v in node)
    qc = quant_config or {}
    return str(qc.get("synthetic", "")).endswith("act") or walk(qc)


def group_order(down) -> torch.Tensor | None:
    """The permutation of down_proj's input columns that sorts its act-order groups into runs of
    group_size, or None where there is nothing to sort (not an act-order Affine weight, or groups that
    are not group_size columns each)."""
    if not isinstance(down, Affine) or down.g_idx is None:
        return None
    g_idx = down.g_idx.long()
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], torch.arange(g_idx.numel(), device=g_idx.device) // down.group_size):
        return None
    return order


def permute_rows(w, order: torch.Tensor):
    """`w`'s output rows in `order` (a plain tensor, 1-D bias included, or an Affine weight), else None."""
    if isinstance(w, torch.Tensor):
        return w[order.to(w.device)]
    if isinstance(w, Affine):
        rows = {f: getattr(w, f)[order.to(w.codes.device)] for f in ("codes", "scales", "mins", "zeros")
                if isinstance(getattr(w, f), torch.Tensor)}
        return dataclasses.replace(w, **rows)
    return None


def sort_down_groups(down: Affine, order: torch.Tensor) -> Affine:
    """down_proj with its input columns in `order` (group_order's): plain groups, no g_idx."""
    return dataclasses.replace(down, codes=down.codes[:, order.to(down.codes.device)], g_idx=None)


def sort_mlp(gate, up, down, gate_bias=None, up_bias=None):
    """(gate, up, down, gate_bias, up_bias) with the intermediate features renumbered so that down_proj's
    act-order groups are contiguous; unchanged where down_proj has no act-order groups to sort or gate_proj /
    up_proj are of a kind whose rows cannot be reordered exactly.

    GPTQ with act-order (desc_act) quantizes a weight's input columns in a data-chosen order, so column k
    belongs to scale group g_idx[k] and a group's columns lie scattered over K. For down_proj, K is the MLP's
    intermediate feature axis, and an MLP computes the same function under any permutation of its
    intermediate features applied together to gate_proj's and up_proj's rows and down_proj's columns
    (SiLU(gate) * up acts feature by feature). Permuting by the order that sorts g_idx turns down_proj into
    an ordinary grouped weight (column k in group k // group_size) with the same codes, scales and zero
    points: exact, nothing requantized.

    It matters twice: the packing kernels then read down_proj's activations in order (no gather), and under
    tensor parallelism each rank's down_proj piece holds whole groups, so it stays packed instead of falling
    back to a dequantized copy (a contiguous cut of a scattered act-order weight has uneven groups)."""
    order = group_order(down)
    if order is None:
        return gate, up, down, gate_bias, up_bias
    rows = [permute_rows(w, order) for w in (gate, up)]
    if any(r is None for r in rows):
        return gate, up, down, gate_bias, up_bias
    biases = [None if b is None else permute_rows(b, order) for b in (gate_bias, up_bias)]
    return rows[0], rows[1], sort_down_groups(down, order), biases[0], biases[1]
