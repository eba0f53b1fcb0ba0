"""LoRARequest: which adapter a request runs with, spelled as vLLM spells it."""
from __future__ import annotations

from dataclasses import dataclass

from quanta.quant.errors import ConfigError


@dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest(lora_name, lora_int_id, lora_path)`: a peft adapter directory or a GGUF LoRA file at
    `lora_path`, known to the engine by `lora_int_id` (a positive integer, unique per adapter: two requests
    with the same id share one loaded copy and one prefix cache) and named `lora_name` in outputs and the
    server's model list."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ConfigError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ConfigError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive integer, "
                              f"got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
