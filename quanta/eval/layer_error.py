"""Per-layer weight error between two checkpoints of one model: each weight matrix dequantized to float32
on both sides, one tensor at a time, so at most two float32 copies of one matrix exist at once, and the mapped
file pages each was read from given back once compared."""
from __future__ import annotations

import torch
from tqdm import tqdm

from quanta.eval.result import LayerError
from quanta.loaders.checkpoint import Checkpoint
from quanta.loaders.pages import release
from quanta.quant.qtensor import QTensor


def _is_matrix(name: str, shape) -> bool:
    """Weight matrices (linear layers, embeddings, lm_head); norms and biases are vectors."""
    return name.endswith(".weight") and len(shape) == 2


def _dense(t) -> tuple[torch.Tensor, str]:
    if isinstance(t, QTensor):
        return t.dequantize(torch.float32), t.describe()
    return t.float(), f"dense {str(t.dtype).removeprefix('torch.')}"


def compare(weight: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error ||W - R|| / ||R||, max |W - R|) of two float32 matrices, norms in float64."""
    diff = weight - reference
    err = torch.linalg.vector_norm(diff, dtype=torch.float64).item()
    ref = torch.linalg.vector_norm(reference, dtype=torch.float64).item()
    rel = err / ref if ref > 0 else (0.0 if err == 0 else float("inf"))
    return rel, diff.abs().max().item() if diff.numel() else 0.0


def weight_errors(model: Checkpoint, reference: Checkpoint, progress: bool = False
                  ) -> tuple[list[LayerError], list[str]]:
    """(one LayerError per matrix both checkpoints hold, in the tested checkpoint's order; the matrices
    that were not compared, each with why: in one checkpoint only, or of another shape)."""
    ours, theirs = model.tensors, reference.tensors
    ref_names = set(theirs)
    errors, unmatched = [], []
    for name in tqdm(list(ours), desc="weight error", disable=not progress):
        tensor = ours[name]
        if not _is_matrix(name, tensor.shape):
            ref_names.discard(name)
            continue
        if name not in ref_names:
            unmatched.append(f"{name} (not in the reference)")
            continue
        ref_names.discard(name)
        w, scheme = _dense(tensor)
        ref_tensor = theirs[name]
        r, ref_scheme = _dense(ref_tensor)
        if r.shape != w.shape:
            unmatched.append(f"{name} (shape {list(w.shape)}, reference {list(r.shape)})")
            continue
        rel, max_abs = compare(w, r)
        errors.append(LayerError(name, list(w.shape), scheme, ref_scheme, rel, max_abs))
        del w, r
        release([tensor, ref_tensor])
        del tensor, ref_tensor
    unmatched += [f"{name} (not in the tested checkpoint)" for name in sorted(ref_names)
                  if _is_matrix(name, theirs[name].shape)]
    return errors, unmatched
