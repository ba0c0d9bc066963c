"""`python -m llmcourse generate`, run as a user runs it."""

import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


# -- chat ------------------------------------------------------------------------------------------------------

SCENE = (
    "{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}\n\n{% elif m.role == 'user' %}"
    "ROMEO:\n{{ m.content }}\n\n{% else %}JULIET:\n{{ m.content }}\n\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}JULIET:\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """gpt2-shakespeare as a chat model: its weights, GPT-2's tokenizer as tokenizer.json (built from the same
    official files) and a chat template that makes a conversation a scene."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    from llmcourse.engine.loading import MODELS_DIR
    from llmcourse.engine.tokenizer import vocab_files

    folder = tmp_path_factory.mktemp("chat")
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(MODELS_DIR / "gpt2-shakespeare" / name)
    files = vocab_files()
    tok = Tokenizer(models.BPE.from_file(str(files["encoder.json"]), str(files["vocab.bpe"])))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "chat_template": SCENE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def chat_here(capsys, monkeypatch, lines: str, *args):
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    return run_here(capsys, "chat", *args)


def test_the_chat_tokenizer_is_gpt2s(chat_folder, tokenizer):
    from llmcourse.engine.hf_tokenizer import load_tokenizer

    tok = load_tokenizer(chat_folder)
    text = "ROMEO:\nBut soft! 🦙 <|endoftext|> what light"
    assert tok.encode(text) == tokenizer.encode(text, allowed_special="all")
    assert tok.eos_token_ids == (50256,)


def test_generate_uses_the_folders_tokenizer(chat_folder, capsys):
    """gpt2-shakespeare's weights with GPT-2's tokenizer.json: the text of the bundled model with tiktoken."""
    args = ["--max-new-tokens", "20", "--seed", "1", "--device", "cpu", "ROMEO: 🦙"]
    code, ours, err = run_here(capsys, "generate", "--model", str(chat_folder), *args)
    assert code == 0, err
    assert (0, ours, "") == run_here(capsys, "generate", *args) and len(ours) > 20


def test_chat_streams_replies_through_the_template_and_keeps_the_history(chat_folder, capsys, monkeypatch):
    """Each reply is the model's greedy continuation of the whole conversation rendered by the chat template
    (earlier replies as the assistant's turns), cut at --stop; /exit ends the conversation."""
    from llmcourse import generate
    from llmcourse.engine.hf_tokenizer import load_tokenizer

    args = ["--model", str(chat_folder), "--temperature", "0", "--max-new-tokens", "30", "--stop", "\n\n"]
    args += ["--device", "cpu", "--system", "A street in Verona."]
    code, out, err = chat_here(capsys, monkeypatch, "Good morrow, fair Juliet.\n\nWhat news?\n/exit\nnot read\n", *args)
    assert code == 0, err
    replies = out.split("\n")
    assert len(replies) == 3 and replies[2] == "" and all(replies[:2]), out
    model, tok = load_model(chat_folder, device="cpu"), load_tokenizer(chat_folder)
    messages = [{"role": "system", "content": "A street in Verona."}]
    for line, reply in zip(["Good morrow, fair Juliet.", "What news?"], replies):
        messages.append({"role": "user", "content": line})
        ids = tok.encode_chat(messages)
        assert tok.decode(ids).endswith(f"ROMEO:\n{line}\n\nJULIET:\n")
        expected = tok.decode(generate(model, ids, max_new_tokens=30, eos_token_id=50256))
        assert reply == expected.split("<|endoftext|>")[0].split("\n\n")[0]
        messages.append({"role": "assistant", "content": reply})


def test_chat_ends_at_end_of_input_as_a_user_runs_it(chat_folder):
    done = subprocess.run(
        [sys.executable, "-m", "llmcourse", "chat", "--model", str(chat_folder), "--max-new-tokens", "8"],
        input="Hello\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n") and done.stdout.strip(), done.stdout


def test_chat_forgets_the_oldest_turns_when_the_model_is_full(chat_folder, capsys, monkeypatch):
    """gpt2-shakespeare has 256 positions: each long turn pushes the one before out; a message longer than
    the model can take is refused with a message, and the conversation goes on."""
    long, too_long = "Speak, speak! " * 30, "Speak! " * 200
    args = ["--model", str(chat_folder), "--max-new-tokens", "40", "--device", "cpu", "--temperature", "0"]
    code, out, err = chat_here(capsys, monkeypatch, f"{long}\n{long}\n{too_long}\n{long}\n", *args, "--stop", "\n")
    assert code == 0, err
    assert out.count("\n") == 3 and err.count("oldest turn is forgotten") == 2, err
    assert "but the model has room for 216 (its positions less --max-new-tokens): shorten it" in err, err


def test_chat_needs_a_chat_template(small_folder, capsys, monkeypatch):
    code, out, err = chat_here(capsys, monkeypatch, "Hello\n", "--model", str(small_folder))
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "has no chat template" in err and "--model llama-shakespeare" in err and "generate" in err


def test_chat_settings_errors_are_in_flag_terms(chat_folder, capsys, monkeypatch):
    code, out, err = chat_here(capsys, monkeypatch, "Hello\n", "--model", str(chat_folder), "--top-p", "2")
    assert code == 2 and err.count("\n") == 1 and "--top-p must be in (0, 1]" in err, err


@pytest.mark.skipif(
    not (Path(__file__).resolve().parents[1] / "llmcourse" / "models" / "llama-shakespeare").is_dir(),
    reason="the bundled llama-shakespeare is not there yet",
)
def test_chat_with_the_bundled_modern_model(capsys, monkeypatch):
    code, out, err = chat_here(capsys, monkeypatch, "Good morrow!\n", "--max-new-tokens", "20", "--device", "cpu")
    assert code == 0, err
    assert out.strip(), out


@pytest.fixture(scope="module")
def llama_chat_folder(tmp_path_factory):
    """A tiny random Llama 3.1-style chat model as transformers saves it, with a Llama 3 tokenizer built here."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .test_hf_tokenizer import LLAMA3_PATTERN, LLAMA3_SPECIAL, LLAMA31_TEMPLATE, byte_level_tokenizer, write_folder

    tok = byte_level_tokenizer(LLAMA3_PATTERN, LLAMA3_SPECIAL, bos="<|begin_of_text|>")
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIAL}
    eos = [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]
    folder = tmp_path_factory.mktemp("llama-chat")
    config = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA31_TEMPLATE)
    write_folder(folder, tok, config, {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": eos})
    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=ids["<|begin_of_text|>"],
        eos_token_id=eos,
    )
    LlamaForCausalLM(hf).save_pretrained(folder)
    return folder


def test_chat_with_a_llama_model_saved_by_transformers(llama_chat_folder, capsys, monkeypatch):
    """A Llama 3.1-style model: the chat template's ids (one <|begin_of_text|>) go to the model and the reply
    stops at any of its three EOS ids."""
    import llmcourse.__main__ as cli
    from llmcourse import generate
    from llmcourse.engine.hf_tokenizer import load_tokenizer

    seen = []
    real_stream = cli.stream

    def spy(model, tokenizer, prompt, params, **kwargs):
        seen.append((list(prompt), params.eos_token_id))  # the chat template's ids
        return real_stream(model, tokenizer, prompt, params, **kwargs)

    monkeypatch.setattr(cli, "stream", spy)
    args = ["--model", str(llama_chat_folder), "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"]
    code, out, err = chat_here(capsys, monkeypatch, "Hi there\nAnd you?\n", *args)
    assert code == 0, err
    tok, model = load_tokenizer(llama_chat_folder), load_model(llama_chat_folder, device="cpu")
    first = [{"role": "user", "content": "Hi there"}]
    assert seen[0][0] == tok.encode_chat(first) and seen[0][0].count(tok.bos_token_id) == 1
    assert [tok.tokenizer.id_to_token(i) for i in seen[0][1]] == ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]
    reply = generate(model, seen[0][0], max_new_tokens=12, eos_token_id=tok.eos_token_ids)
    assert out.startswith(tok.decode([t for t in reply if t not in tok.eos_token_ids]) + "\n")
    assert len(seen) == 2 and tok.decode(seen[1][0]).count("<|start_header_id|>user") == 2
