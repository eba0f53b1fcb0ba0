"""The `quanta` command line on the default model: generate, chat, inspect, and typed errors."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from quanta.tools.cli import main


def test_generate_subprocess_answers(default_model_path):
    """What the README's first command runs: a coherent answer from the default model."""
    out = subprocess.run([sys.executable, "-m", "quanta.tools.cli", "-q", "generate", "--chat-template",
                          "What is the capital of France?", "--max-tokens", "24"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_chat_reads_turns_from_stdin(default_model_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is the capital of France?\nAnd of Italy?\n"))
    assert main(["-q", "chat", "--max-tokens", "24"]) == 0
    replies = capsys.readouterr().out
    assert "Paris" in replies and "Rome" in replies


def test_inspect_json_reports_schemes_and_kernels(default_model_path, capsys):
    assert main(["-q", "inspect", str(default_model_path), "--json", "--device", "cpu"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "gguf" and info["architecture"] == "llama"
    assert info["schemes"]["gguf q4_1"] == 210 and info["schemes"]["gguf q8_0"] == 1
    assert info["kernels"]["gguf q4_1 -> cpu_int4"] == 210
    assert info["kernels"]["gguf q8_0 -> dequantized"] == 1          # the tied lm_head
    file_bytes = default_model_path.stat().st_size
    assert 0.95 * file_bytes < info["bytes"] <= file_bytes          # held as stored, not dequantized


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
