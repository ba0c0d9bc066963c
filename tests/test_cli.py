"""`python -m llmcourse generate`, run as a user runs it."""

import subprocess
import sys

import pytest

from llmcourse import generate_text, load_model


def run(*args):
    return subprocess.run([sys.executable, "-m", "llmcourse", *args], capture_output=True, text=True, timeout=120)


def test_help_documents_every_option():
    out = run("generate", "--help")
    assert out.returncode == 0
    for option in ["--model", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
                   "--repetition-penalty", "--num-beams", "--length-penalty", "--stop", "--seed", "--device", "--dtype",
                   "--compile"]:
        assert option in out.stdout, option
    assert "PROMPT" in out.stdout


def test_generates_from_a_folder_saved_by_transformers(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128)).save_pretrained(tmp_path)
    out = run("generate", "--model", str(tmp_path), "--max-new-tokens", "12", "--temperature", "0.9", "--seed", "3",
              "--device", "cpu", "Once upon a time")
    assert out.returncode == 0, out.stderr
    model = load_model(tmp_path, device="cpu")
    expected = generate_text(model, tokenizer, "Once upon a time", max_new_tokens=12, temperature=0.9, seed=3)
    assert out.stdout == expected + "\n"
    assert len(tokenizer.encode(expected)) >= 10


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["--temperature", "-1"], "temperature must be a number >= 0"),
        (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
        (["--num-beams", "2"], "with num_beams > 1 use temperature=0"),
        (["--num-beams", "2", "--temperature", "0", "--compile"], "beam search runs uncompiled"),
        (["--max-new-tokens", "5000"], "lower max_new_tokens"),
        (["--dtype", "int3"], "argument --dtype: invalid choice"),
        (["--device", "tpu"], "device 'tpu' is not a device; use 'auto', 'cpu', 'cuda'"),
        (["--device", "mps"], "device 'mps' is not supported"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_option_prints_one_line_and_exits_2(small_folder, args, message):
    out = run("generate", "--model", str(small_folder), *args, "Hello")
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


def test_compiled_generation_prints_the_same_text():
    """The bundled model, compiled (torch.compile on the CPU) and not: the same greedy text."""
    args = ["generate", "--temperature", "0", "--max-new-tokens", "24", "--device", "cpu", "ROMEO:"]
    plain, compiled = run(*args), run(*args, "--compile")
    assert plain.returncode == 0 and compiled.returncode == 0, compiled.stderr
    assert compiled.stdout == plain.stdout and len(plain.stdout) > 40


def test_missing_model_is_one_clear_error(tmp_path):
    out = run("generate", "--model", str(tmp_path / "nowhere"), "Hello")
    assert out.returncode == 1
    assert "neither a model folder nor a Hugging Face Hub model name" in out.stderr
    assert "Traceback" not in out.stderr
