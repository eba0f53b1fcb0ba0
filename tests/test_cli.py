"""The `quanta` command line: generate, chat, inspect, their flags, and typed errors."""
from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys

import pytest

from kernel_util import cpu_4bit_kernel  # noqa: I001
from quanta.cli.main import build_parser, main
from quanta.cli.options import byte_size, token_ids

README_QUESTION = "What is the capital of France? Answer with the city name."


def _quanta(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "quanta.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_subprocess_answers_quietly(default_model_path):
    """The README's first command with -q after the sub-command: the answer, and nothing on stderr (no
    `loading:` bar, no kernel log)."""
    out = _quanta("generate", "-q", "--chat-template", README_QUESTION, "--max-tokens", "24")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert out.stderr == ""


def test_generate_stats_report_first_token_and_rate(default_model_path, capsys):
    assert main(["-q", "generate", "--chat-template", README_QUESTION, "--max-tokens", "24", "--stats"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    stats = re.search(r"prompt (\d+) tokens, time to first token (\d+) ms; (\d+) tokens in ([\d.]+) s, "
                      r"decode ([\d.]+) tokens/s", captured.err)
    assert stats, captured.err
    assert int(stats[1]) > 10 and 1 <= int(stats[3]) <= 24 and float(stats[5]) > 0


def test_chat_reads_turns_from_stdin(default_model_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{README_QUESTION}\nAnd of Japan?\n"))
    assert main(["chat", "-q", "--max-tokens", "24"]) == 0
    replies = capsys.readouterr().out
    assert "Paris" in replies and "Tokyo" in replies


@pytest.mark.parametrize("argv", [["-q", "generate", "x"], ["generate", "-q", "x"], ["chat", "--quiet"],
                                  ["inspect", "-q", "model.gguf"]])
def test_quiet_is_accepted_before_or_after_the_subcommand(argv):
    assert build_parser().parse_args(argv).quiet is True


def test_not_quiet_by_default():
    assert build_parser().parse_args(["generate", "x"]).quiet is False


@pytest.mark.parametrize("flag, value, words", [("--temperature", "-1", "--temperature must be >= 0"),
                                                ("--top-p", "0", "--top-p must be in (0, 1]"),
                                                ("--max-tokens", "0", "--max-tokens must be >= 1")])
def test_sampling_flags_are_checked_before_the_model_loads(tmp_path, capsys, flag, value, words):
    """A model path that does not exist would fail the load; the sampling flag's error comes first."""
    missing = tmp_path / "absent.gguf"
    assert main(["-q", "generate", "--model", str(missing), flag, value, "x"]) == 2
    err = capsys.readouterr().err
    assert words in err and str(missing) not in err


def test_engine_memory_flags_reach_the_engine(default_model_path, capsys):
    """--num-kv-blocks and --max-model-len are the engine's: its KV-cache check names what they gave."""
    assert main(["-q", "generate", "--num-kv-blocks", "2", "--max-model-len", "64", "x"]) == 2
    err = capsys.readouterr().err
    assert "32 tokens (2 blocks of 16)" in err and "max_model_len=64" in err


def test_engine_flags_map_to_llm_keywords():
    from quanta.cli.options import engine_kwargs
    args = build_parser().parse_args(["generate", "x", "--gpu-memory-utilization", "0.5", "--kv-cache-memory",
                                      "2GiB", "--kv-cache-dtype", "fp8", "--max-num-seqs", "8", "--tokenizer",
                                      "tok", "--num-kv-blocks", "10", "--enforce-eager", "--no-prefix-caching",
                                      "--max-gpu-memory", "15GiB"])
    assert engine_kwargs(args) == {"gpu_memory_utilization": 0.5, "kv_cache_memory": 2 << 30,
                                   "kv_cache_dtype": "fp8", "max_num_seqs": 8, "tokenizer": "tok",
                                   "num_kv_blocks": 10, "enforce_eager": True, "enable_prefix_caching": False,
                                   "max_gpu_memory": "15GiB", "seed": 0}


def test_sizes_and_token_ids_parse():
    assert byte_size("512MiB") == 512 << 20 and byte_size("2GB") == 2 * 10**9 and byte_size("4096") == 4096
    assert token_ids("1,2, 3") == [1, 2, 3] and token_ids("7 8") == [7, 8]
    for bad in ("lots", "-1GiB", "1.5XB"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        token_ids("1,a")


@pytest.fixture(scope="module")
def untokenized_model(tmp_path_factory):
    from tiny_models import build_tiny_hf
    path, _ = build_tiny_hf("llama", tmp_path_factory.mktemp("no-tokenizer"), tokenizer=False)
    return path


def test_model_without_tokenizer_takes_token_ids(untokenized_model, capsys):
    assert main(["-q", "generate", "--model", str(untokenized_model), "--prompt-token-ids", "1,2,3",
                 "--max-tokens", "4", "--ignore-eos"]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 4 and all(t.isdigit() for t in printed)


def test_model_without_tokenizer_says_how_to_give_a_prompt(untokenized_model, capsys):
    assert main(["-q", "generate", "--model", str(untokenized_model), "hello"]) == 2
    assert "--prompt-token-ids" in capsys.readouterr().err


def test_tokenizer_flag_gives_a_model_its_tokenizer(untokenized_model, capsys):
    from tiny_models import tokenizer_dir
    assert main(["-q", "generate", "--model", str(untokenized_model), "--tokenizer", str(tokenizer_dir()),
                 "hello", "--max-tokens", "3", "--ignore-eos"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_prompt_given_twice_or_never_is_an_error(capsys):
    assert main(["-q", "generate"]) == 2
    assert main(["-q", "generate", "x", "--prompt-token-ids", "1"]) == 2
    assert capsys.readouterr().err.count("quanta: error:") == 2


def test_synthetic_model_too_large_for_the_cpu_cache_fails_at_once(capsys):
    """The KV-cache check needs no weights (the engine's tests show it fails before building any)."""
    assert main(["-q", "generate", "--model", "synthetic:llama3-8b:w4g128", "--device", "cpu",
                 "--prompt-token-ids", "1,2,3", "--kv-cache-memory", "1MiB"]) == 2
    assert "max_model_len" in capsys.readouterr().err


def _inspect(path, *extra) -> subprocess.CompletedProcess:
    out = _quanta("inspect", str(path), "--device", "cpu", *extra)
    assert out.returncode == 0, out.stderr
    return out


def test_inspect_json_reports_schemes_and_kernels(default_model_path):
    info = json.loads(_inspect(default_model_path, "--json", "-q").stdout)
    assert info["format"] == "gguf" and info["architecture"] == "llama"
    assert info["schemes"]["gguf q4_1"] == 210 and info["schemes"]["gguf q8_0"] == 1
    gemms = {g["name"]: g for g in info["gemms"]}
    assert len(gemms) == 30 * 4 + 1                        # qkv, o, gate_up, down per layer; the lm_head
    kernel = cpu_4bit_kernel()[0]
    head_kernel = "cpu_vnni" if kernel == "cpu_vnni" else "cpu_ggml"     # the tied Q8_0 table at its bytes
    assert gemms["model.layers.0.self_attn.q_proj+k_proj+v_proj"]["kernel"] == kernel
    assert gemms["lm_head"]["kernel"] == head_kernel
    file_bytes = default_model_path.stat().st_size
    assert 0.95 * file_bytes < info["bytes"] <= file_bytes          # held as stored, once, not dequantized
    head = info["memory"]["weights"][f"gguf q8_0 -> {head_kernel}"]  # the file's blocks' bytes, nothing more
    assert head["bytes"] == head["stored_bytes"] == 49152 * 576 // 32 * 34


def test_inspect_says_what_dtype_runs(default_model_path):
    """float32 activations, but the 4-bit GEMMs compute from 8-bit blocks (cpu_vnni, and the Q8_0 lm_head with
    them) or at bfloat16 input (cpu_int4; the lm_head on cpu_ggml in float32)."""
    out = _inspect(default_model_path, "-q").stdout
    assert "activations in float32" in out
    kernel, computes = cpu_4bit_kernel()
    assert re.search(rf"gguf q4_1 -> {kernel} \(computes in {computes}, output float32\)", out), out
    head = "cpu_vnni in int8" if kernel == "cpu_vnni" else "cpu_ggml in float32"
    assert re.search(rf"lm_head: gguf q8_0 -> {head}", out), out


def test_inspect_says_what_the_dequantized_fallback_costs(default_model_path):
    """In float16 no CPU kernel takes the weights: the tied Q8_0 lm_head is dequantized to fp16, 49152 x 576 x 2
    bytes against its stored 49152 x 576 / 32 x 34."""
    info = json.loads(_inspect(default_model_path, "--json", "-q", "--dtype", "float16").stdout)
    entry = info["memory"]["weights"]["gguf q8_0 -> dequantized"]
    assert entry["bytes"] == 49152 * 576 * 2 and entry["stored_bytes"] == 49152 * 576 // 32 * 34
    assert "1.88x its 28.7 MiB stored" in _inspect(default_model_path, "-q", "--dtype", "float16").stdout


def test_inspect_reports_a_fallback_once(default_model_path, monkeypatch):
    """Without native code (no VNNI or ggml kernel), the tied Q8_0 lm_head falls back past cpu_int4: one note
    for it, not one per layer."""
    monkeypatch.setenv("QUANTA_NATIVE", "0")
    out = _inspect(default_model_path)
    reason = "cpu_int4: needs plain 4-bit groups, weight is gguf q8_0"
    assert (out.stdout + out.stderr).count(reason) == 1, out.stdout + out.stderr


def test_inspect_layers_sorted_by_number(default_model_path):
    out = _inspect(default_model_path, "--layers", "-q").stdout
    order = [int(n) for n in re.findall(r"model\.layers\.(\d+)\.", out)]
    first_seen = list(dict.fromkeys(order))
    assert first_seen == list(range(30))


def test_bad_model_path_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    assert main(["-q", "generate", "--model", str(bad), "hi"]) == 2
    err = capsys.readouterr().err
    assert "quanta: error:" in err and str(bad) in err


@pytest.mark.parametrize("argv", [["generate", "x", "--temperature", "-1"], ["generate", "x", "--dtype", "int3"]])
def test_bad_arguments_are_clear_errors(argv, default_model_path, capsys):
    assert main(["-q", *argv]) == 2
    assert "quanta: error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["generate", "--temperature", "-3", "x"],
                                  ["convert", "x", "--bogus"]])
def test_help_and_flag_errors_come_before_torch_loads(argv):
    """Parsing the command line, its help and the flags' own checks import neither torch nor the engine: they
    answer at once (the library loads only for the work)."""
    code = ("import runpy, sys; sys.argv = ['quanta', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('quanta.cli.main', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().endswith("NO-TORCH"), out.stderr[-2000:]


def test_a_signal_wrapped_by_a_lazy_import_still_ends_the_command_as_the_signal():
    """SIGTERM raised inside an import that transformers wraps (RuntimeError from Terminated) ends the command with
    143 and the interrupted message, as a bare SIGTERM does; any other error still propagates."""
    code = ("from quanta.cli.interrupt import Terminated, ends_cleanly\n"
            "with ends_cleanly('quantize', 'OUT'):\n"
            "    try:\n"
            "        raise Terminated()\n"
            "    except Terminated as e:\n"
            "        raise RuntimeError('Failed to import transformers.generation.utils') from e\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 143 and "terminated; nothing was written at OUT" in run.stderr
    other = subprocess.run([sys.executable, "-c", code.replace("raise Terminated()", "raise ValueError()")],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 1 and "ValueError" in other.stderr
