"""The models shipped in llmcourse/models: offline, deterministic, and as good as their cards say."""

import os
import re
import subprocess
import sys

import pytest
import torch

from llmcourse import generate, get_tokenizer, load_model
from llmcourse.engine.loading import BUNDLED, DEFAULT_MODEL, MODELS_DIR
from llmcourse.training.shakespeare import validation_figures, validation_tokens

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
    assert total <= 40 * 2**20, f"bundled models take {total / 2**20:.1f} MiB"
    assert DEFAULT_MODEL == "gpt2-shakespeare"


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


@pytest.fixture(scope="module")
def figures(target, draft):
    """Both models over the held-out plays, in one pass (the slowest part of this file)."""
    return validation_figures(target, draft, validation_tokens())


def test_validation_loss_equals_the_model_cards(figures):
    assert figures["validation_loss"] == pytest.approx(card_figure("gpt2-shakespeare", "validation loss"), abs=2e-4)
    card = card_figure("gpt2-shakespeare-draft", "validation loss")
    assert figures["draft_validation_loss"] == pytest.approx(card, abs=2e-4)


def test_models_beat_the_unigram_baseline():
    for name in BUNDLED:
        card = (MODELS_DIR / name / "README.md").read_text(encoding="utf-8")
        unigram = float(re.search(r"\| unigram baseline[^|]*\| ([0-9.]+)", card).group(1))
        assert card_figure(name, "validation loss") < unigram - 1.0


def test_draft_acceptance_rate_equals_its_card(figures):
    alpha = figures["acceptance_rate"]
    assert alpha == pytest.approx(card_figure("gpt2-shakespeare-draft", "acceptance rate"), abs=2e-4)
    assert 0.3 < alpha < 1


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
