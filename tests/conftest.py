"""Shared pytest fixtures."""

# ==== gguf / real-model fixtures (owner: GGUF loader work) =========================================
import os
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is first imported, so
# it is set here, before any test module imports quanta: without CUDA every Triton kernel then runs
# under the interpreter on the CPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# No test may reach a model hub: transformers and huggingface_hub stay offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Path of the default real model (SmolLM2-135M-Instruct, Q4_1 GGUF); skips when it is absent."""
    from quanta.quant.errors import QuantaError
    from quanta.cli.default_model import default_model_path as find
    try:
        return find()
    except QuantaError as e:
        pytest.skip(f"real model missing: {e}")
# ==== end gguf / real-model fixtures ===============================================================
