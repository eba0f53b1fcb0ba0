"""The models `quanta bench` measures: one MODEL in each asked format. A known shape (llama-3-8b, ...) becomes
synthetic weights at that shape in each format; a real checkpoint is measured as it is, and converted into
each asked format (RTN, or GPTQ for act-order) in a scratch folder, removed afterwards."""
from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from quanta.loaders.detection import detect
from quanta.loaders.shapes import KNOWN_MODELS
from quanta.quant.errors import ConfigError, QuantaError
from quanta.toolkit.bench.names import DEFAULT_FORMATS

GROUPS = (128, 64, 32)          # the group size of integer formats: the first that divides every linear's K


@dataclass(frozen=True)
class Recipe:
    """How to make one bench format: the synthetic format name, or `quanta quantize` / `convert` options."""
    synthetic: str
    quantize: dict[str, Any] = field(default_factory=dict)     # quanta.quantize keywords (method, bits, ...)
    convert: str | None = None                                 # or a float dtype: quanta.convert to hf


def recipe(name: str, group: int) -> Recipe:
    """The recipe of bench format `name` with integer groups of `group` columns; ConfigError naming the known
    formats otherwise."""
    g = f"g{group}"
    recipes = {
        "fp16": Recipe("fp16", convert="float16"),
        "bf16": Recipe("bf16", convert="bfloat16"),
        "awq": Recipe(f"w4{g}z", dict(method="rtn", bits=4, group_size=group, symmetric=False, format="awq")),
        "gptq": Recipe(f"w4{g}", dict(method="rtn", bits=4, group_size=group, symmetric=True, format="gptq")),
        "gptq-act-order": Recipe(f"w4{g}act", dict(method="gptq", bits=4, group_size=group, act_order=True,
                                                   n_samples=8, seqlen=256)),
        "w8": Recipe(f"w8{g}", dict(method="rtn", bits=8, group_size=group, symmetric=True, format="gptq")),
        "nf4": Recipe("nf4", dict(method="nf4")),
        "fp8": Recipe("fp8", dict(method="fp8")),
    }
    if name.lower().startswith("gguf:"):
        t = name[5:]
        return Recipe(f"gguf-{t.lower() if t.lower().endswith('_m') else _ggml_case(t)}",
                      dict(method="gguf", type=t.upper()))
    if name not in recipes:
        raise ConfigError(f"bench format {name!r} is not one of {', '.join(recipes)}, gguf:TYPE")
    return recipes[name]


def _ggml_case(t: str) -> str:
    """A GGML type as its table names it: q4_0, q4_K (K-quants keep their capital K)."""
    t = t.lower()
    return t[:-1] + "K" if t.endswith("_k") else t


def parse_formats(spec: str | list[str] | None) -> list[str]:
    """Bench format names from a comma list (default: DEFAULT_FORMATS), each checked."""
    names = DEFAULT_FORMATS if spec is None else spec.split(",") if isinstance(spec, str) else spec
    names = [n.strip() for n in names if n.strip()]
    for n in names:
        recipe(n, 128)
    return names


def is_shape(model: str) -> bool:
    """Whether `model` names a published shape (synthetic weights) rather than a checkpoint on disk."""
    return model.strip().lower() in KNOWN_MODELS and not Path(model).exists()


@dataclass
class Variant:
    """One model to measure: its bench format, what LLM() opens, and the checkpoint it came from."""
    model: str                  # as the user named it
    format: str                 # the bench format, or "as is (<family>)"
    path: str                   # a synthetic spec or a checkpoint path
    converted: bool = False     # made by the bench from `model`
    error: str | None = None    # why it could not be made (the format cannot hold this model, say)


def group_for(model: str) -> int:
    """The largest of GROUPS that divides every linear layer's input size of `model`."""
    from quanta.planner.model_shapes import resolve_config
    c = resolve_config(model)
    ks = (c.hidden_size, c.num_attention_heads * c.head_dim, c.intermediate_size)
    return next((g for g in GROUPS if all(k % g == 0 for k in ks)), GROUPS[-1])


@contextmanager
def variants(model: str, formats: list[str], quiet: bool = True) -> Iterator[Iterator[Variant]]:
    """The variants of `model` in `formats`, made one at a time as they are asked for (a conversion's folder
    lives until the next variant is asked for, then goes; all are gone when the block ends)."""
    scratch = Path(tempfile.mkdtemp(prefix="quanta-bench-"))
    try:
        yield _each(model, formats, scratch, quiet)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _each(model: str, formats: list[str], scratch: Path, quiet: bool) -> Iterator[Variant]:
    group = group_for(model)
    if is_shape(model):
        for name in formats:
            yield Variant(model, name, f"synthetic:{model.strip().lower()}:{recipe(name, group).synthetic}")
        return
    yield Variant(model, f"as is ({detect(model)})", str(model))
    for name in formats:
        out = scratch / name.replace(":", "-")
        try:
            make(model, recipe(name, group), out, quiet)
        except QuantaError as e:
            yield Variant(model, name, str(out), converted=True, error=f"{type(e).__name__}: {e}")
            continue
        yield Variant(model, name, str(out), converted=True)
        _remove(out)


def _remove(path: Path) -> None:
    """A conversion's output, a folder or one GGUF file."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def make(model: str, r: Recipe, out: Path, quiet: bool) -> Path:
    """Write `model` in recipe `r`'s format at `out` (a GGUF file or a checkpoint directory)."""
    if r.convert is not None:
        from quanta.toolkit.convert.pipeline import convert
        convert(model, "hf", out, dtype=r.convert, validate=False, quiet=quiet)
        return out
    from quanta.toolkit.quantize.pipeline import quantize
    options = dict(r.quantize)
    quantize(model, out, options.pop("method"), quiet=quiet, **options)
    return out
