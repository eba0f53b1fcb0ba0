"""LoRA adapters over any base format: requests (request.py), reading peft and GGUF adapters (adapter.py),
the engine's adapter slots (slots.py) and the batched products (kernels.py)."""
from quanta.lora.adapter import Adapter, LoRAWeights, load_adapter
from quanta.lora.request import LoRARequest

__all__ = ["Adapter", "LoRARequest", "LoRAWeights", "load_adapter"]
