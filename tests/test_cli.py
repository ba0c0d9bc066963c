"""`python -m llmcourse generate`, run as a user runs it."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmcourse import generate_text, load_model

from .release import released


def run(*args):
    return subprocess.run([sys.executable, "-m", "llmcourse", *args], capture_output=True, text=True, timeout=120)


def run_here(capsys, *args):
    """The command line's `main` in this process (no 3 s interpreter start): exit code, stdout, stderr.
    The other tests run it as a user does, in a process of its own."""
    from llmcourse.__main__ import main

    try:
        code = main(list(args))
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_documents_every_option():
    out = run("generate", "--help")
    assert out.returncode == 0
    for option in [
        "--model",
        "--max-new-tokens",
        "--temperature",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repetition-penalty",
        "--num-beams",
        "--length-penalty",
        "--stop",
        "--seed",
        "--device",
        "--dtype",
        "--compile",
        "--parts",
    ]:
        assert option in out.stdout, option
    assert "PROMPT" in out.stdout


def test_generates_from_a_folder_saved_by_transformers(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128)).save_pretrained(tmp_path)
    out = run(
        "generate",
        "--model",
        str(tmp_path),
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "3",
        "--device",
        "cpu",
        "Once upon a time",
    )
    assert out.returncode == 0, out.stderr
    model = load_model(tmp_path, device="cpu")
    expected = generate_text(model, tokenizer, "Once upon a time", max_new_tokens=12, temperature=0.9, seed=3)
    assert out.stdout == expected + "\n"
    assert len(tokenizer.encode(expected)) >= 10


PARAMETER = re.compile(
    r"(?<![-\w])(max_new_tokens|temperature|top_k|top_p|min_p|repetition_penalty|num_beams|"
    r"length_penalty|compile)(?![-\w])"
)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "1.5"], "--top-p must be in (0, 1] (1 = off), got 1.5"),
        (["--temperature", "-1"], "--temperature must be a number >= 0"),
        (["--top-k", "x"], "argument --top-k: invalid int value: 'x'"),
        (["--min-p", "2"], "--min-p must be in [0, 1]"),
        (["--repetition-penalty", "0"], "--repetition-penalty must be a number > 0"),
        (["--num-beams", "2", "--temperature", "0.5"], "with --num-beams > 1 use --temperature 0"),
        (["--num-beams", "0"], "--num-beams must be an integer >= 1"),
        (["--num-beams", "2", "--compile"], "beam search runs uncompiled, so use --num-beams 1 or leave out --compile"),
        (
            ["--max-new-tokens", "5000"],
            "--max-new-tokens is 5000: 5001 positions, but the model has only "
            "n_positions=256; lower --max-new-tokens to at most 255",
        ),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
        (["--stop", ""], "--stop needs a non-empty text"),
        (["--dtype", "int3"], "argument --dtype: invalid choice"),
        (["--device", "tpu"], "device 'tpu' is not a device; use 'auto', 'cpu', 'cuda'"),
        (["--device", "mps"], "device 'mps' is not supported"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_option_prints_one_line_in_flag_terms_and_exits_2(small_folder, args, message, capsys):
    code, out, err = run_here(capsys, "generate", "--model", str(small_folder), *args, "Hello")
    assert code == 2
    assert err.count("\n") == 1 and message in err, err
    assert "Traceback" not in err and out == ""
    assert not PARAMETER.search(err), "errors name the flags, not Python's keyword arguments"


def test_an_empty_prompt_gets_a_hint_the_command_line_can_take(small_folder):
    out = run("generate", "--model", str(small_folder), "")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "PROMPT is empty" in out.stderr and '"<|endoftext|>"' in out.stderr and "[50256]" not in out.stderr
    start = run("generate", "--model", str(small_folder), "--max-new-tokens", "5", "--device", "cpu", "<|endoftext|>")
    assert start.returncode == 0 and len(start.stdout) > 1, start.stderr


def test_default_temperature_samples_and_beams_are_greedy(small_folder, tokenizer):
    """Without --temperature the command line samples at 0.8; with --num-beams it is greedy (beam
    search needs it), so `--num-beams 3` alone works."""
    model = load_model(small_folder, device="cpu")
    sampled = run(
        "generate", "--model", str(small_folder), "--max-new-tokens", "12", "--seed", "5", "--device", "cpu", "Hello"
    )
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout == generate_text(model, tokenizer, "Hello", max_new_tokens=12, temperature=0.8, seed=5) + "\n"
    beams = run(
        "generate",
        "--model",
        str(small_folder),
        "--num-beams",
        "3",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "Hello",
    )
    assert beams.returncode == 0, beams.stderr
    assert beams.stdout == generate_text(model, tokenizer, "Hello", max_new_tokens=8, num_beams=3) + "\n"
    assert "default: 0.8, or 0 with --num-beams > 1" in " ".join(run("generate", "--help").stdout.split())


def test_a_misspelt_bundled_model_says_what_was_meant():
    out = run("generate", "--model", "gpt2-shakespear", "Hello")
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert "no bundled model 'gpt2-shakespear'; did you mean 'gpt2-shakespeare'?" in out.stderr


ROOT = Path(__file__).resolve().parents[1]


def test_parts_runs_your_engine_with_one_notice_per_unwritten_slot(small_folder, tokenizer, tmp_path):
    """`generate --parts chapters/`: the learner's functions where their checks pass, the engine's
    elsewhere, notices on stderr (each once, only for exercises with a slot), the text on stdout."""
    for name in ("00_pipeline", "01_tokenization"):
        shutil.copytree(released(name), tmp_path / name)
    args = ["--model", str(small_folder), "--temperature", "0", "--max-new-tokens", "10", "--device", "cpu", "ROMEO:"]
    out = run("generate", "--parts", str(tmp_path), *args)
    assert out.returncode == 0, out.stderr
    model = load_model(small_folder, device="cpu")
    assert out.stdout == generate_text(model, tokenizer, "ROMEO:", max_new_tokens=10) + "\n"
    assert out.stderr.splitlines() == [
        "01_tokenization: encode is not written yet; the engine's encode runs instead",
        "01_tokenization: decode is not written yet; the engine's decode runs instead",
        "01_tokenization: stream_decoder is not written yet; the engine's StreamDecoder runs instead",
        "your engine: the engine's own parts (none of yours is used yet)",
    ]
    from .test_course import solved_copy

    solved_copy("01_tokenization", tmp_path)
    solved = run("generate", "--parts", str(tmp_path / "01_tokenization"), *args)
    assert solved.returncode == 0 and solved.stdout == out.stdout, solved.stderr
    assert solved.stderr.splitlines() == [
        "your engine: your StreamDecoder, decode, encode, the engine's own for the rest"
    ]
    missing = run("generate", "--parts", str(tmp_path / "nope"), *args)
    assert missing.returncode == 2 and "--parts: no folder" in missing.stderr and missing.stderr.count("\n") == 1


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


def test_num_draft_tokens_takes_auto_and_names_a_bad_word(capsys):
    """--num-draft-tokens auto: the text of plain greedy decoding, and the k chosen in the summary."""
    args = ["generate", "--max-new-tokens", "16", "--temperature", "0"]
    auto = ["--num-draft-tokens", "auto"]
    code, plain, _ = run_here(capsys, *args, "ROMEO:")
    code, text, err = run_here(capsys, *args, "--draft", "gpt2-shakespeare-draft", *auto, "ROMEO:")
    assert code == 0 and text == plain
    assert re.search(r"num_draft_tokens='auto' chose k = \d \(α = [\d.]+, c = 0\.27\)", err), err
    code, text, err = run_here(capsys, *args, "--draft", "prompt-lookup", "--num-draft-tokens", "fast", "ROMEO:")
    assert code == 2 and text == "" and err.count("\n") == 1
    assert "--num-draft-tokens: expected a whole number of tokens or 'auto', got 'fast'" in err
