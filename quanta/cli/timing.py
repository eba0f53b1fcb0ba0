"""What `quanta generate --stats` prints: a request's token counts and times, local or from a server."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Timing:
    prompt_tokens: int
    output_tokens: int
    first_token_s: float
    total_s: float

    def line(self) -> str:
        decode_s = self.total_s - self.first_token_s
        rate = (self.output_tokens - 1) / decode_s if self.output_tokens > 1 and decode_s > 0 else float("nan")
        return (f"stats: prompt {self.prompt_tokens} tokens, time to first token "
                f"{self.first_token_s * 1e3:.0f} ms; {self.output_tokens} tokens in {self.total_s:.2f} s, "
                f"decode {rate:.1f} tokens/s")
