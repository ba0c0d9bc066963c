"""Chapter 12's checks (`llmcourse.checks.capstone`): your whole engine against the reference, mode by mode.

An engine made of the engine's own functions (standing for a learner who wrote them all) passes; an engine where
any function a mode runs is still the engine's own fails that mode naming the chapter to finish (so the untouched
release scores zero); a wrong function is found and named by its chapter; a function that computes the same
numbers another way is accepted (the hidden prompts are chosen where the reference's greedy choice is clear).
"""

from __future__ import annotations

import codecs
import dataclasses
from pathlib import Path

import pytest
import torch

from llmcourse.checks import capstone
from llmcourse.course import bpe
from llmcourse.course.failed import CheckFailed
from llmcourse.course.learner import ENGINE_SLOTS, ROOFLINE_SLOTS, pieces_of
from llmcourse.course.progress import read_chapter
from llmcourse.engine.decoder import KVCache
from llmcourse.engine.padding import left_pad
from llmcourse.engine.parts import Parts, rms_norm
from llmcourse.engine.quantize import Quantization
from llmcourse.engine.sampling import Sampler
from llmcourse.engine.speculative import Speculation
from llmcourse.engine.structured.structuring import Structuring
from llmcourse.serving.batching import Batching

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]


class StreamDecoder:
    """Chapter 01's StreamDecoder(vocab), as a learner writes it."""

    def __init__(self, vocab):
        self.vocab, self.utf8 = vocab, codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token):
        return self.utf8.decode(self.vocab[token])

    def flush(self):
        return self.utf8.decode(b"", final=True)


def all_yours(**instead) -> dict:
    """Every slot filled with the engine's own function, as a learner who finished every chapter has them."""
    fns = {
        f.name: f.default
        for t in (Parts, Sampler, Speculation, Quantization, Batching, Structuring)
        for f in dataclasses.fields(t)
    }
    fns |= dict(KVCache=KVCache, left_pad=left_pad, decode=bpe.decode, StreamDecoder=StreamDecoder)
    fns["encode"] = lambda text, ranks: bpe.encode(text, ranks=ranks)
    return fns | instead


def quiet(line):
    pass


@pytest.fixture(autouse=True)
def small(monkeypatch):
    """Fewer and shorter hidden prompts than the chapter's: the same machinery, a fraction of the time."""
    monkeypatch.setattr(capstone, "NEW_TOKENS", 8)
    monkeypatch.setattr(capstone, "PROMPTS", 2)
    capstone.hidden_prompts.cache_clear()
    yield
    capstone.hidden_prompts.cache_clear()


def test_each_slot_is_named_by_the_chapter_whose_exercise_it_is():
    found = {}
    for path in sorted(ROOT.glob("solutions/*/*.ipynb")):
        chapter = read_chapter(path)
        found.update({n: chapter.name for ex in chapter.exercises for n in ex.functions if n in ENGINE_SLOTS})
    run_in_engines = {n: c for n, c in found.items() if n not in ROOFLINE_SLOTS and n not in ("smooth_scales",)}
    assert {n: capstone.CHAPTER_OF[n] for n in run_in_engines} == run_in_engines
    assert set(capstone.CHAPTER_OF) == set(run_in_engines)


@pytest.mark.parametrize("mode", list(capstone.MODES))
def test_an_engine_with_none_of_yours_fails_every_mode_naming_the_chapters(mode):
    with pytest.raises(CheckFailed) as err:
        capstone.check_mode(mode, pieces_of({}, notify=quiet))
    message = str(err.value)
    assert f"✗ capstone {mode} — this mode runs functions that are still the engine's own:" in message
    chapters = {capstone.CHAPTER_OF[s] for s in capstone.mode_slots(mode)}
    assert all(c in message for c in chapters) and "hint: finish" in message


def test_the_modes_run_what_they_say():
    assert {"BlockAllocator", "schedule", "paged_attention", "merge_attention"} <= capstone.mode_slots("llm_engine")
    assert "KVCache" not in capstone.mode_slots("llm_engine")
    assert {"encode", "decode", "StreamDecoder", "rms_norm", "layer_norm"} <= capstone.mode_slots("single")
    assert {"accept_token", "verify", "speculative_round", "prompt_lookup_draft"} <= capstone.mode_slots("speculative")
    assert {"quantize_int4", "dequantize_int4", "pack_int4"} <= capstone.mode_slots("int4")
    assert {"temperature", "top_k", "top_p", "sample"} <= capstone.mode_slots("sampled")
    assert "sample" not in capstone.mode_slots("batched")


def test_one_missing_function_fails_the_modes_that_run_it_and_only_those(capsys):
    fns = all_yours()
    del fns["top_k"]
    pieces = pieces_of(fns, notify=quiet)
    with pytest.raises(CheckFailed, match=r"still the engine's own:\n  05_sampling \(top_k\): not found"):
        capstone.check_mode("sampled", pieces)
    capstone.check_mode("batched", pieces)
    assert "✓ capstone batched — 2 runs" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["llm_engine", "sampled"])
def test_an_engine_of_right_functions_passes(mode, capsys):
    capstone.check_mode(mode, pieces_of(all_yours(), notify=quiet))
    assert capsys.readouterr().out.startswith(f"✓ capstone {mode}")


def rms_norm_eps_outside(x, weight, eps):  # a mistake: eps added to the root, not under it
    xf = x.float()
    return (xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps) * weight.float()).to(x.dtype)


def rms_norm_in_float64(x, weight, eps):  # right, computed another way: within rounding of the reference
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def test_a_wrong_function_is_found_and_named_by_its_chapter():
    pieces = pieces_of(all_yours(rms_norm=lambda x, w, eps: rms_norm_eps_outside(x, w, 50 * eps + 0.05)), notify=quiet)
    with pytest.raises(CheckFailed) as err:
        capstone.check_mode("batched", pieces)
    message = str(err.value)
    assert "llama-shakespeare batched, prompt " in message and "of seed 0" in message and "differs: expected" in message
    assert "the difference comes from your rms_norm (11_modern)" in message


def test_a_right_function_computed_another_way_is_accepted(capsys):
    assert rms_norm_in_float64 is not rms_norm
    capstone.check_mode("batched", pieces_of(all_yours(rms_norm=rms_norm_in_float64), notify=quiet))
    assert capsys.readouterr().out.startswith("✓ capstone batched")


def test_a_function_that_raises_stops_the_mode_with_its_name():
    def broken_swiglu(gate, up):
        raise ValueError("not today")

    with pytest.raises(CheckFailed, match="your engine stopped: .*swiglu"):
        capstone.check_mode("batched", pieces_of(all_yours(swiglu=broken_swiglu), notify=quiet))


def test_hidden_prompts_have_a_clear_lead_and_differ_per_model():
    gpt2 = capstone.hidden_prompts(capstone.GPT2)
    llama = capstone.hidden_prompts(capstone.LLAMA)
    assert len(gpt2) == len(llama) == 2 and gpt2 != llama
    assert not set(capstone.hidden_prompts(capstone.GPT2, seed=101)) & set(gpt2)  # the graded run's are others
    for text, ids in gpt2 + llama:
        assert 8 <= len(ids) <= 26 and text.strip()
        assert capstone.clear_lead(
            capstone.reference_model(capstone.GPT2 if (text, ids) in gpt2 else capstone.LLAMA), list(ids)
        )


def test_the_engine_report_says_chapter_by_chapter_what_is_yours_and_why_the_rest_is_not():
    from llmcourse.course.learner import engine_report

    fns = all_yours()
    del fns["top_k"], fns["rope"]
    origins = {"top_k": ("05_sampling", "top_k", "does not pass its check (keeps k + 1 tokens)")}
    lines = engine_report(pieces_of(fns, notify=quiet, origins=origins)).splitlines()
    assert len(lines) == len(set(capstone.CHAPTER_OF.values())) == 11  # chapters 01-11 and 13 (no slots: 00, 10, 12)
    assert lines[0] == "01_tokenization  yours: encode, decode, StreamDecoder"
    assert "02_embeddings    yours: embedding; the engine's: rope (its notebook was not found)" in lines
    sampling = next(line for line in lines if line.startswith("05_sampling"))
    assert sampling.endswith("the engine's: top_k (does not pass its check (keeps k + 1 tokens))")
    assert sum("the engine's" in line for line in lines) == 2
