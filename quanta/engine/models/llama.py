"""The llama-family decoder: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), built on the meta
device and filled from a Checkpoint by `model_loader.build_model`; under tensor parallelism (`tp`) each
rank's modules hold its cut of every weight (LlamaForCausalLM says which).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from quanta.engine.layers import Cut, Embedding, MergedQuantLinear, QuantLinear, RMSNorm, RotaryEmbedding
from quanta.engine.parallel.group import TensorParallel, kv_head_range, vocab_range
from quanta.cpu import matmul as cpu_matmul
from quanta.loaders.checkpoint import ModelConfig


def _rows(full: int, start: int, stop: int) -> Cut:
    return Cut(0, start, stop, full)


def _split(full: int, tp: TensorParallel | None, dim: int) -> Cut | None:
    """An equal piece per rank along `dim` (None without tensor parallelism)."""
    if tp is None:
        return None
    per = full // tp.world
    return Cut(dim, tp.rank * per, (tp.rank + 1) * per, full, keep_bias=tp.rank == 0)


def add_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None,
             tp: TensorParallel | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), x alone where there is no residual yet; under tensor parallelism
    x is this rank's partial sum, summed over the ranks in the same step (TensorParallel.reduce_norm)."""
    return tp.reduce_norm(x, residual, norm) if tp is not None else norm.add_norm(x, residual)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, triton: bool, tp: TensorParallel | None = None):
        super().__init__()
        self.layer, self.head_dim = layer, cfg.head_dim
        d = cfg.head_dim
        world, rank = (tp.world, tp.rank) if tp else (1, 0)
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.num_heads = heads // world
        kv0, kv1 = kv_head_range(kv_heads, rank, world)
        self.num_kv_heads = kv1 - kv0
        self.scale = d ** -0.5
        bias = cfg.attention_bias
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        cuts = None
        if tp is not None:
            q0 = rank * self.q_size
            cuts = [_rows(heads * d, q0, q0 + self.q_size)] + [_rows(kv_heads * d, kv0 * d, kv1 * d)] * 2
        self.qkv_proj = MergedQuantLinear(cfg.hidden_size, {"q_proj": self.q_size, "k_proj": self.kv_size,
                                                            "v_proj": self.kv_size}, bias, triton, cuts)
        self.o_proj = QuantLinear(self.q_size, cfg.hidden_size, False, cut=_split(heads * d, tp, 1))
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, triton) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, triton) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rope: Callable, ctx) -> torch.Tensor:
        t = x.shape[0]
        qkv = self._qkv_rotated_and_stored(x, rope, ctx)
        if qkv is not None:
            out = ctx.attend_cached(self.layer, qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim),
                                    self.scale)
        else:
            q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            out = ctx.attend(self.layer, q, k, v, self.scale, rope)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _qkv_rotated_and_stored(self, x: torch.Tensor, rope: Callable, ctx) -> torch.Tensor | None:
        """[q | k | v] with rotary and the KV store done in the q/k/v GEMM's epilogue, where the step and the
        kernel allow it (no q/k norms between the GEMM and the rotation); else None."""
        if self.q_norm is not None:
            return None
        store = ctx.rope_store(self.layer, rope, self.q_size, self.kv_size, self.head_dim)
        return self.qkv_proj.forward_rope_store(x, store) if store is not None else None


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, triton: bool, tp: TensorParallel | None = None):
        super().__init__()
        full = cfg.intermediate_size
        size = full // (tp.world if tp else 1)
        rows = _split(full, tp, 0)
        self.gate_up_proj = MergedQuantLinear(cfg.hidden_size, {"gate_proj": size, "up_proj": size}, triton=triton,
                                              cuts=None if rows is None else [rows, rows])
        self.down_proj = QuantLinear(size, cfg.hidden_size, cut=_split(full, tp, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.down_proj(self.gate_up_proj.forward_glu(x, fp8_rows=self.down_proj.takes_fp8_rows(rows)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, triton: bool, tp: TensorParallel | None = None):
        super().__init__()
        self.tp = tp
        self.self_attn = LlamaAttention(cfg, layer, triton, tp)
        self.mlp = LlamaMLP(cfg, triton, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Callable,
                ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's input x, the residual stream before it) -> (its output, the stream before that);
        the layer's true output is their sum, formed by the next norm. Under tensor parallelism x and the
        output are this rank's partial sums, which the next norm sums over the ranks first."""
        h, residual = add_norm(self.input_layernorm, x, residual, self.tp)
        h = self.self_attn(h, rope, ctx)
        h, residual = add_norm(self.post_attention_layernorm, h, residual, self.tp)
        return self.mlp(h), residual

    def feed_in_weight_order(self) -> None:
        """Each norm's output has one reader, the q/k/v and the gate/up GEMMs. Where that GEMM's kernel gathers
        its input columns in an order of its own (act-order groups sorted at load), the norm writes them in that
        order instead: the same numbers, read in order, and no gather per weight tile."""
        for norm, linear in ((self.input_layernorm, self.self_attn.qkv_proj),
                             (self.post_attention_layernorm, self.mlp.gate_up_proj)):
            order = linear.take_input_order()
            if order is not None:
                norm.write_in_order(order)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device, triton: bool, tp: TensorParallel | None = None):
        super().__init__()
        vocab = None if tp is None else _rows(cfg.vocab_size, *vocab_range(cfg.vocab_size, tp.rank, tp.world))
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, vocab)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, triton, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device, triton)


class LlamaForCausalLM(nn.Module):
    """Decoder + lm_head. Tied embeddings share the embedding's (possibly quantized) table. `device`: where
    the model will run (the rotary frequencies, which no checkpoint holds, are made there as the model is
    built); `triton`: whether the norms, rotary and SiLU-and-mul run as Triton kernels (the engine decides
    it once, with the KV cache's); `tp`: this rank's tensor-parallel group (None: the whole model).

    forward() takes a flat list of a step's tokens and an attention context that owns the KV cache
    (engine/forward_batch.py). q/k/v and gate/up run as one GEMM each (MergedQuantLinear); the residual
    stream is carried beside the hidden state so that each RMSNorm adds it in the same pass (vLLM's layout).

    Tensor parallelism splits a llama as Megatron / vLLM do: q/k/v and gate/up are column-parallel (each part
    cut by rows: this rank's query heads, its KV heads -- one replicated head when there are fewer KV heads
    than ranks -- and its share of the intermediate rows); o_proj and down_proj are row-parallel (cut by input
    columns; their partial outputs summed over the ranks by the RMSNorm that reads them next, in one kernel on
    GPUs); the embedding and lm_head are vocab-parallel (rows in pieces of cdiv(vocab, world); the embedding's
    partial lookups summed by the first norm, the logits pieces gathered). Norms and rotary are replicated.
    Every cut happens as the weight is read (layers.Cut), before its kernel repacks it."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", triton: bool = False,
                 tp: TensorParallel | None = None):
        super().__init__()
        self.config, self.tp = cfg, tp
        self.model = LlamaModel(cfg, torch.device(device), triton, tp)
        self._head_bound: torch.Tensor | None = None       # what the lm_head's refine bounds from (compute_logits)
        if tp is None:
            self.lm_head = QuantLinear(cfg.hidden_size, cfg.vocab_size)
        else:
            start, stop = vocab_range(cfg.vocab_size, tp.rank, tp.world)
            self.lm_head = QuantLinear(cfg.hidden_size, stop - start, cut=_rows(cfg.vocab_size, start, stop))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (after the last norm)."""
        x, residual = self.model.embed_tokens(input_ids), None
        rope = self.model.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x, residual = layer(x, residual, rope, ctx)
        return add_norm(self.model.norm, x, residual, self.tp)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits; the lm_head may compute in another dtype than the layers (EngineConfig.lm_head_dtype).
        A 16-bit plain-weight lm_head, or one on cpu_int8, under float32 activations on the CPU has the entries
        that can be a row's largest recomputed in float32 (cpu_matmul.refine_top; per rank, before the vocabulary
        is gathered)."""
        head = self.lm_head
        logits = head(hidden.to(head.dtype)).float()
        if hidden.dtype == torch.float32 and hidden.device.type == "cpu":
            logits = self._refined(logits, hidden, head.state)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.config.vocab_size)

    def _refined(self, logits: torch.Tensor, hidden: torch.Tensor, state) -> torch.Tensor:
        """The lm_head's logits with those that can be a row's largest recomputed in float32, where its kernel
        computed below float32: cpu_int8 bounds each logit by its row's norm, a 16-bit plain weight every logit
        by the columns' maxima (the data made once: the weights never change)."""
        if hasattr(state, "exact_products"):
            if self._head_bound is None:
                self._head_bound = state.row_norms()
            return cpu_matmul.refine_top_rows(logits, hidden, state.exact_products, self._head_bound,
                                              torch.finfo(state.dtype).eps, state.roundings)
        if isinstance(state, torch.Tensor) and state.dtype != torch.float32:
            if self._head_bound is None:
                self._head_bound = cpu_matmul.column_max(state)
            return cpu_matmul.refine_top(logits, hidden, state, self._head_bound)
        return logits
