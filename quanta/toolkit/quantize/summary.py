"""What a quantization produced, measured from the files written: size, bits per weight, per-layer error.

    s = summarize(out, opts, ckpt, report, seconds)     # QuantizeSummary
    print(s.table(worst=5)); s.to_json()

Bits per weight are the stored bytes of every tensor belonging to a decoder linear (codes, scales,
zeros, g_idx, absmax, ...), read back from the safetensors headers or the GGUF tensor table, over
the linears' weight count; "overall" is the whole output's size over all of the model's parameters.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quanta.loaders.hf import canonical_shapes

LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj")
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")


@dataclass
class QuantizeSummary:
    """The result of `quanta.quantize` (see the module docstring); errors are relative (||ΔW|| / ||W||)."""
    out: str
    method: str
    format: str
    scheme: str
    seconds: float
    bytes_on_disk: int
    linear_bits_per_weight: float
    overall_bits_per_weight: float
    layers: list[dict] = field(default_factory=list)     # {name, scheme, weight_error, output_error}

    def worst(self, n: int) -> list[dict]:
        """The n linears with the largest output error (weight error where none was measured)."""
        rows = [r for r in self.layers if r["scheme"] != "layer"]
        return sorted(rows, key=lambda r: -(r["output_error"] if r["output_error"] is not None
                                             else r["weight_error"] or 0.0))[:n]

    def table(self, worst: int = 5) -> str:
        """A few lines for the terminal."""
        lines = [f"quantized {self.scheme} in {self.seconds:.1f} s",
                 f"  written to       {self.out}",
                 f"  size on disk     {self.bytes_on_disk / 2**20:.1f} MiB",
                 f"  bits per weight  {self.linear_bits_per_weight:.3f} (quantized linears), "
                 f"{self.overall_bits_per_weight:.3f} (whole model)"]
        rows = self.worst(worst)
        if rows:
            lines.append(f"  largest errors (of {sum(r['scheme'] != 'layer' for r in self.layers)} weights):")
            for r in rows:
                out = "" if r["output_error"] is None else f"  output {r['output_error']:.4f}"
                lines.append(f"    {r['name']:<42} weight {r['weight_error']:.4f}{out}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def disk_bytes(path: Path) -> int:
    """Size of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _stored_linear_bytes(out: Path) -> int:
    """Bytes of the stored tensors of decoder linears in the written checkpoint."""
    if out.is_file():
        from quanta.loaders.gguf.file import read_gguf
        return sum(t.nbytes for t in read_gguf(out, vocabularies=False).tensors if GGUF_LINEAR.fullmatch(t.name))
    from quanta.loaders.safetensors_io import read_safetensors_header
    total = 0
    for f in out.glob("*.safetensors"):
        for name, info in read_safetensors_header(f)[0].items():
            if LINEAR.match(name):
                total += _numel(info.shape) * DTYPE_BYTES[info.dtype]
    return total


def summarize(out: Path, opts, ckpt, report: list, seconds: float) -> QuantizeSummary:
    """The summary of a finished run writing `out` (report: quantize_model ReportRow-like rows)."""
    shapes = canonical_shapes(ckpt.config)
    if ckpt.config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    params = sum(_numel(s) for s in shapes.values())
    linear_params = sum(_numel(s) for n, s in shapes.items() if LINEAR.match(n))
    size = disk_bytes(out)
    layers = [{"name": r.name, "scheme": r.scheme, "weight_error": r.weight_error, "output_error": r.output_error}
              for r in report]
    return QuantizeSummary(str(out), opts.method, opts.format, opts.describe(), seconds, size,
                           8 * _stored_linear_bytes(out) / linear_params, 8 * size / params, layers)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
