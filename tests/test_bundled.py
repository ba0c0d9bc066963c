"""The models shipped in llmcourse/models: offline, deterministic, and as good as their cards say."""

import hashlib
import os
import re
import subprocess
import sys

import pytest
import torch

from llmcourse import generate, get_tokenizer, load_model
from llmcourse.engine.bpe_training import BPETokenizer
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.loading import BUNDLED, DEFAULT_MODEL, MODELS_DIR
from llmcourse.training.shakespeare import EVAL_CONTEXT, VALIDATION_FILE, validation_figures, validation_tokens

# Greedy continuation of "ROMEO:" by gpt2-shakespeare, recorded when the model was trained.
# token ids as a paragraph of numbers, not one per line
# fmt: off
RECORDED_GREEDY = [198, 40, 423, 587, 257, 582, 11, 290, 314, 423, 587, 198, 2514, 423, 257, 582, 13, 198, 198, 44879,
                   40, 3535, 1565, 2937, 25, 198, 40, 423, 587, 257, 582, 11, 198, 40, 1183, 407, 257, 582, 13, 198]
# fmt: on
# = "\nI have been a man, and I have been\nTo have a man.\n\nCORIOLANUS:\nI have been a man,\nI'll not a man.\n"


def card_figure(name: str, label: str) -> float:
    card = (MODELS_DIR / name / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"\| {label}[^|]*\| \*\*([0-9.]+)\*\*", card)
    assert match, f"the {name} model card has no '{label}' figure"
    return float(match.group(1))


@pytest.fixture(scope="module")
def target():
    return load_model("gpt2-shakespeare", device="cpu")


@pytest.fixture(scope="module")
def draft():
    return load_model("gpt2-shakespeare-draft", device="cpu")


def test_bundled_models_are_small_and_complete():
    total = 0
    for name in BUNDLED:
        folder = MODELS_DIR / name
        for file in ("config.json", "model.safetensors", "README.md"):
            assert (folder / file).is_file(), f"{name}/{file}"
        total += sum(f.stat().st_size for f in folder.iterdir())
    assert total <= 60 * 2**20, f"bundled models take {total / 2**20:.1f} MiB"
    assert DEFAULT_MODEL == "gpt2-shakespeare"


def test_the_modern_model_has_its_tokenizer_files():
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "training.json"):
        assert (MODELS_DIR / "llama-shakespeare" / file).is_file(), file


def test_models_have_gpt2s_architecture_and_vocabulary(target, draft):
    for model in (target, draft):
        assert model.config.vocab_size == 50257
    assert draft.config.n_layer < target.config.n_layer and draft.config.n_embd < target.config.n_embd
    assert load_model().config == target.config  # the default


def test_greedy_output_is_deterministic_and_recorded(target):
    ids = get_tokenizer().encode("ROMEO:")
    first = generate(target, ids, max_new_tokens=40)
    assert generate(target, ids, max_new_tokens=40) == first
    assert first == RECORDED_GREEDY


# The cards' validation figures are over the whole held-out plays (418 windows of 256 tokens; 3 minutes on 2 cores).
# They belong to these exact weights, and the suite checks the engine on the first SLICE windows, whose figures
# were recorded beside the cards' (the first 16 windows: 4,097 tokens). A change of the weights or of the engine's
# arithmetic that moves the whole set's loss by about 1 % moves the slice's by some 100 times the tolerance, also
# when it touches only tokens the slice lacks. Measured on gpt2-shakespeare (issue 39): noise on the positions past
# 128, +1.27 % on the whole set, +0.066 on the slice (329x the 2e-4 tolerance); noise on the embeddings of the
# 6,256 token types that the slice lacks, +0.21 % / +2.31 %, moved the slice by 25x / 242x (through the tied head).
SLICE = 16
WEIGHTS_SHA256 = {
    "gpt2-shakespeare": "9d44770804944adba2437cb364eea07c663c98fe5f2bc7990f237830bad6cff4",
    "gpt2-shakespeare-draft": "a570df9822338b646307cc6569dde2c908e95b0f1f0d8f9407634ac2c801dbc5",
    "llama-shakespeare": "eb80a47b68bc8b37c9bc335a360c1d3afadb9de313104c4f09f69d9c92aa1a6b",
}
SLICE_FIGURES = {"validation_loss": 4.1903, "draft_validation_loss": 4.9300, "acceptance_rate": 0.5751}


def test_the_cards_figures_belong_to_the_shipped_weights():
    for name, digest in WEIGHTS_SHA256.items():
        found = hashlib.sha256((MODELS_DIR / name / "model.safetensors").read_bytes()).hexdigest()
        assert found == digest, (
            f"{name}'s weights changed: measure its card's figures again over the whole validation set "
            "(llmcourse.training.shakespeare.validation_figures) and record the new hash and the slice's figures here"
        )


@pytest.fixture(scope="module")
def figures(target, draft):
    """Both models over the first SLICE windows of the held-out plays, in one pass."""
    tokens = validation_tokens()
    return validation_figures(target, draft, tokens[: SLICE * EVAL_CONTEXT + 1])


def test_validation_loss_equals_the_recorded_one(figures):
    assert figures["validation_loss"] == pytest.approx(SLICE_FIGURES["validation_loss"], abs=2e-4)
    assert figures["draft_validation_loss"] == pytest.approx(SLICE_FIGURES["draft_validation_loss"], abs=2e-4)


def test_models_beat_the_unigram_baseline():
    for name in BUNDLED:
        card = (MODELS_DIR / name / "README.md").read_text(encoding="utf-8")
        unigram = float(re.search(r"\| unigram baseline[^|]*\| ([0-9.]+)", card).group(1))
        assert card_figure(name, "validation loss") < unigram - 1.0


def test_draft_acceptance_rate_equals_the_recorded_one(figures):
    alpha = figures["acceptance_rate"]
    assert alpha == pytest.approx(SLICE_FIGURES["acceptance_rate"], abs=2e-4)
    assert 0.3 < card_figure("gpt2-shakespeare-draft", "acceptance rate") < 1


def test_transformers_loads_the_bundled_model_with_equal_logits(target):
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    hf = GPT2LMHeadModel.from_pretrained(MODELS_DIR / "gpt2-shakespeare", dtype=torch.float32).eval()
    ids = torch.tensor([get_tokenizer().encode("ROMEO:\nBut soft, what light through yonder window breaks?")])
    with torch.no_grad():
        assert (target(ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_cli_default_model_writes_shakespeare_offline():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "llmcourse", "generate", "--max-new-tokens", "60", "ROMEO:"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert len(text.split()) > 20
    assert re.search(r"^[A-Z][A-Z ]+:$", text, re.MULTILINE), f"no speaker line in:\n{text}"


# ----------------------------------------------------------------------------------------------------------------
# llama-shakespeare: Llama's architecture, its own vocabulary, a chat template that makes a conversation a scene

LLAMA = MODELS_DIR / "llama-shakespeare"
# Greedy continuation of "ROMEO:" by llama-shakespeare, past the speech's end (eos_token_id=None), recorded when
# it was trained.
# fmt: off
LLAMA_RECORDED_GREEDY = [10, 73, 460, 258, 450, 329, 293, 364, 258, 450, 327, 1010, 46, 267, 91, 734, 355, 267, 267,
                         909, 1399, 46, 434, 2633, 305, 268, 849, 46, 267, 91, 531, 258, 439, 2616, 355, 267, 91, 531,
                         258, 439]
# fmt: on
# = "\nI am a man that I have a man's wife.\n\n[Exit.]\n\n\n\nSCENE II. A room in the King.\n\n"
#   "[Enter a Messenger.]\n\n[Enter a M"


@pytest.fixture(scope="module")
def llama():
    return load_model("llama-shakespeare", device="cpu")


@pytest.fixture(scope="module")
def llama_tokenizer():
    return load_tokenizer("llama-shakespeare")


def card_bits_per_byte(name: str) -> float:
    card = (MODELS_DIR / name / "README.md").read_text(encoding="utf-8")
    return float(
        re.search(r"\| validation loss, llama-shakespeare \| \*\*[0-9.]+\*\* \| \*\*([0-9.]+)\*\*", card).group(1)
    )


def test_llama_is_a_small_llama_with_grouped_query_attention(llama, llama_tokenizer):
    c = llama.config
    assert c.model_type == "llama" and c.n_kv_head < c.n_head and c.tie_word_embeddings
    assert c.vocab_size == llama_tokenizer.n_vocab == 4096 and c.n_positions == 256
    eot, blank = llama_tokenizer.encode("<|endoftext|>"), llama_tokenizer.encode("\n\n")
    assert set(llama_tokenizer.eos_token_ids) == {*eot, *blank} and len(blank) == 1


def test_llama_greedy_output_is_recorded(llama, llama_tokenizer):
    ids = llama_tokenizer.encode("ROMEO:")
    assert generate(llama, ids, max_new_tokens=40, eos_token_id=None) == LLAMA_RECORDED_GREEDY


LLAMA_SLICE_LOSS = 4.2309  # its first SLICE windows' (the card's figure, over all 443 windows: 10 s more)


def test_llama_validation_loss_equals_the_recorded_one_and_its_card_in_bits_per_byte(llama, llama_tokenizer):
    from llmcourse.training.shakespeare import bits_per_byte

    tokens = validation_tokens(tokenizer=llama_tokenizer)
    loss = validation_figures(llama, None, tokens[: SLICE * EVAL_CONTEXT + 1])["validation_loss"]
    assert loss == pytest.approx(LLAMA_SLICE_LOSS, abs=2e-4)
    tokenizer = BPETokenizer.from_file(LLAMA / "tokenizer.json")  # our own encoder, from the shipped file
    assert tokenizer.encode(VALIDATION_FILE.read_text(encoding="utf-8")) == tokens.tolist()
    bpb = bits_per_byte(card_figure("llama-shakespeare", "validation loss"), tokens, tokenizer=tokenizer)
    assert bpb == pytest.approx(card_bits_per_byte("llama-shakespeare"), abs=2e-4)


def test_transformers_gives_the_same_tokens_and_chat_text(llama, llama_tokenizer):
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    hf_tokenizer = AutoTokenizer.from_pretrained(LLAMA)
    text = VALIDATION_FILE.read_text(encoding="utf-8")[:20_000] + "<|endoftext|>🦙 naïve\n\n\n  x"
    assert hf_tokenizer.encode(text) == llama_tokenizer.encode(text)
    chat = [
        {"role": "system", "content": "Verona. A garden."},
        {"role": "user", "content": "Good morrow, fair lady."},
        {"role": "assistant", "content": "Good morrow, sir."},
        {"role": "user", "content": "Why dost thou weep?", "name": "Hamlet"},
    ]
    rendered = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (
        rendered
        == llama_tokenizer.apply_chat_template(chat)
        == (
            "<|endoftext|>[Verona. A garden.]\n\nROMEO:\nGood morrow, fair lady.\n\nJULIET:\nGood morrow, sir.\n\n"
            "HAMLET:\nWhy dost thou weep?\n\nJULIET:\n"
        )
    )

    hf = LlamaForCausalLM.from_pretrained(LLAMA, dtype=torch.float32).eval()
    prompt = llama_tokenizer.encode_chat(chat)
    ours = generate(llama, prompt, max_new_tokens=60)  # ends at the blank line (the speech's end) or <|endoftext|>
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False)[0, len(prompt) :].tolist()
        assert (llama(torch.tensor([prompt])) - hf(torch.tensor([prompt])).logits).abs().max().item() < 1e-4
    assert ours == theirs


def test_cli_generates_with_the_modern_model_offline():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmcourse",
            "generate",
            "--model",
            "llama-shakespeare",
            "--max-new-tokens",
            "60",
            "ROMEO:",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    speech = out.stdout.strip()
    assert speech and "\n\n" not in speech  # Romeo's speech, ended by the blank line (an EOS id)
