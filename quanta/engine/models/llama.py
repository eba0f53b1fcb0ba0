"""The llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Built on the meta device, then filled from a Checkpoint by `load_weights` (quantized linear
weights go through QuantLinear's kernels). forward() takes a flat list of a step's tokens and an
attention context that owns the KV cache (engine/forward_batch.py).
"""
from __future__ import annotations

import torch
from torch import nn

from quanta.engine.layers import Embedding, QuantLinear, RMSNorm, RotaryEmbedding
from quanta.loaders.checkpoint import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer, self.head_dim = layer, cfg.head_dim
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.scale = cfg.head_dim ** -0.5
        bias = cfg.attention_bias
        self.q_proj = QuantLinear(cfg.hidden_size, self.num_heads * self.head_dim, bias)
        self.k_proj = QuantLinear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias)
        self.v_proj = QuantLinear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias)
        self.o_proj = QuantLinear(self.num_heads * self.head_dim, cfg.hidden_size, False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = ctx.attend(self.layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = QuantLinear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = QuantLinear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = QuantLinear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, ctx) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


class LlamaForCausalLM(nn.Module):
    """Decoder + lm_head. Tied embeddings share the embedding's (possibly quantized) table."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = QuantLinear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (after the last norm)."""
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, positions, self.model.rotary, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
