"""The tensor stream of `quanta quantize --method gguf`: each weight quantized to the GGML type
llama-quantize gives it for the asked type or mix (gguf.mix.assign), one tensor at a time.

    stream = GgufStream(ckpt, "Q4_K_M", calibration=None, quiet=False)
    write_gguf(dst, ckpt, stream, ggml_type="Q4_K_M")      # Gguf weights of the asked type pass as they are
    stream.report                                          # [ReportRow] weight errors

With an imatrix file (llama-imatrix's, loaders/gguf/imatrix.py) each tensor takes its entry by GGUF name, as
llama-quantize does. With calibration data the importance matrix is collected as llama-imatrix does (the mean of
x_k^2 over every token row reaching a linear, quant.ggml.quantize.Imatrix) by running the unquantized model one
decoder layer at a time (quant/calibration.py); each layer's linears are quantized with it as soon as that layer
has run. The embedding and lm_head then have no entry (llama-imatrix records the decoder's matmul inputs only).
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from quanta.loaders.gguf.mix import assign
from quanta.loaders.gguf.writer import gguf_name
from quanta.quant.ggml.quantize import QUANTIZERS, Imatrix, quantize_with_error
from quanta.quant.qtensor import QTensor
from quanta.quant.quantize_model import LAYER_NAME, ReportRow, as_float, model_order, names_by_layer

# Linear -> the linear whose input it shares (one Imatrix per distinct input).
INPUT_OF = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
            "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
            "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}


class GgufStream:
    """Iterate for (canonical name, Gguf or float tensor); `report` fills as it runs."""

    def __init__(self, ckpt, ggml_type: str, calibration=None, quiet: bool = False, imatrix_file=None,
                 dataset: str | None = None):
        self.ckpt, self.calibration, self.quiet, self.dataset = ckpt, calibration, quiet, dataset
        self.types = assign(ggml_type, ckpt.config, imatrix=calibration is not None or imatrix_file is not None)
        self.report: list[ReportRow] = []
        self.names = sorted(ckpt.tensors, key=model_order)
        self.imatrix_file = imatrix_file
        self.file = None if imatrix_file is None else self._read_file(imatrix_file)
        self.collected: dict[str, Imatrix] = {}      # GGUF name -> the Imatrix collected for it, as it runs

    def _read_file(self, path):
        """llama-imatrix's file, its entries by GGUF name checked against the weights' columns before any work
        (entries for tensors this model lacks are ignored, as llama-quantize ignores them)."""
        from quanta.quant.errors import ShapeError
        from quanta.loaders.gguf.imatrix import load_imatrix

        found = load_imatrix(path)
        entries = found.weights
        for name in self.names:
            key = gguf_name(name)
            if key in entries and entries[key].numel() != self.ckpt.tensors[name].shape[-1]:
                raise ShapeError(f"imatrix {path}: entry {key!r} has {entries[key].numel()} values but the weight "
                                 f"has {self.ckpt.tensors[name].shape[-1]} columns (an imatrix of another model?)")
        return found

    def imatrix_metadata(self) -> dict[str, str | int]:
        """The quantize.imatrix.* entries of the written file, once the stream has run: llama-quantize's for a file
        (its name, first dataset, entries and chunks); for one collected here the same less the file (the
        calibration text's name, the linears collected, the calibration windows); none without an imatrix."""
        if self.file is not None:
            return self.file.quantize_metadata(str(self.imatrix_file))
        if not self.collected:
            return {}
        meta: dict[str, str | int] = {"quantize.imatrix.entries_count": len(self.collected),
                                      "quantize.imatrix.chunks_count": int(self.calibration.tokens.shape[0])}
        if self.dataset:
            meta = {"quantize.imatrix.dataset": self.dataset} | meta
        return meta

    def _weights_of(self, name: str, collected: torch.Tensor | None) -> torch.Tensor | None:
        """The importance weights for tensor `name`: the file's entry when a file was given (llama-quantize looks
        every tensor up by name), else the ones collected from the calibration text."""
        if self.file is not None:
            return self.file.weights.get(gguf_name(name))
        return collected

    def _quantized(self, name: str, t, imatrix: torch.Tensor | None):
        """`t` as the Gguf of its assigned type, or unchanged when the mix keeps it in float."""
        want = self.types.of_tensor(gguf_name(name))
        if want not in QUANTIZERS:              # norms, biases (no type assigned) and float-kept weights
            return t if not isinstance(t, QTensor) else t.dequantize(self.ckpt.config.torch_dtype)
        w = as_float(t) if isinstance(t, QTensor) else t     # float weights go to float32 a chunk at a time
        imatrix = self._weights_of(name, imatrix)
        q, err = quantize_with_error(w, want, imatrix, what=name)
        self.report.append(ReportRow(name, want.upper() + (" imatrix" if imatrix is not None else ""), err, None))
        return q

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor | QTensor]]:
        from tqdm import tqdm

        tensors, cfg = self.ckpt.tensors, self.ckpt.config
        by_layer = names_by_layer(self.names)
        runner = x = None
        if self.calibration is not None:
            from quanta.quant.calibration import LayerRunner
            runner = LayerRunner(cfg)
            x = as_float(tensors["model.embed_tokens.weight"])[self.calibration.tokens]
        yield "model.embed_tokens.weight", self._quantized("model.embed_tokens.weight",
                                                           tensors["model.embed_tokens.weight"], None)
        desc = f"quantize {self.types.name}"
        for i in tqdm(range(cfg.num_hidden_layers), desc=desc, disable=self.quiet):
            names = by_layer.get(i, [])
            originals = {LAYER_NAME.fullmatch(n).group(2): tensors[n] for n in names}
            weights = imatrix = None
            if runner is not None:
                weights = {rel: as_float(t) for rel, t in originals.items()}
                imatrix, x = self._collect(runner, i, weights, x)
            for n in names:
                rel = LAYER_NAME.fullmatch(n).group(2)
                linear = rel.removesuffix(".weight")
                t = originals[rel] if weights is None else weights[rel]
                if imatrix is not None and linear in INPUT_OF:
                    self.collected[gguf_name(n)] = imatrix[INPUT_OF[linear]]
                yield n, self._quantized(n, t, imatrix[INPUT_OF[linear]].weights()
                                         if imatrix is not None and linear in INPUT_OF else None)
        for name in self.names:
            if model_order(name)[0] == 2:
                yield name, self._quantized(name, tensors[name], None)

    @staticmethod
    def _collect(runner, i: int, weights: dict[str, torch.Tensor], x: torch.Tensor):
        """Run float layer i on x, accumulating one Imatrix per distinct linear input: (imatrices, output)."""
        layer = runner.build(i, weights)
        imatrix = {name: Imatrix(layer.get_submodule(name).weight.shape[1]) for name in set(INPUT_OF.values())}
        out = runner.capture(layer, x, {name: m.add for name, m in imatrix.items()})
        return imatrix, out
