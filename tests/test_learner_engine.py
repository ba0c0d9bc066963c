"""A learner's sampler and KV cache inside the engine: `guarded(Sampler, ...)`, `guard("KVCache", ...)`
and the guard that checks a learner's cache at every step (chapters 05 and 06 plug into these)."""

import pytest
import torch

import llmcourse
from llmcourse import GPT2, GPT2Config, KVCache, PartError
from llmcourse.course.guards import GuardedCache, guard, guarded
from llmcourse.course.learner import Engine
from llmcourse.engine.sampling import Sampler, SamplingParams

from .conftest import lively_model
from .test_checks_kv_cache import KVCache as MyCache  # a learner's cache: the engine's interface, written independently

CONFIG = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=97)
PROMPTS = [[5, 17, 3], [40, 2, 2, 9, 60, 11, 1]]
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3, seed=3, eos_token_id=None)


@pytest.fixture(scope="module")
def model():
    return lively_model(CONFIG, seed=1)


# A learner's functions, written differently from the engine's but with the same answers.


def my_top_k(logits, k):
    kth = logits.sort(dim=-1, descending=True).values[:, min(k, logits.shape[-1]) - 1 : min(k, logits.shape[-1])]
    return torch.where(logits >= kth, logits, torch.full_like(logits, float("-inf")))


def my_top_p(logits, p):
    probs, order = logits.softmax(-1).sort(dim=-1)  # ascending
    remove = probs.cumsum(-1) <= 1 - p
    remove[:, -1] = False
    return logits.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf"))


def my_min_p(logits, p):
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < p * probs.max(-1, keepdim=True).values, float("-inf"))


def my_repetition_penalty(logits, seen, penalty):
    return torch.where(seen & (logits > 0), logits / penalty, torch.where(seen, logits * penalty, logits))


MINE = dict(
    temperature=lambda logits, t: logits * (1 / t),
    top_k=my_top_k,
    top_p=my_top_p,
    min_p=my_min_p,
    repetition_penalty=my_repetition_penalty,
    greedy=lambda logits: logits.max(dim=-1).indices,
    sample=lambda logits, generator: torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0],
)


class GrowingCache(MyCache):
    """Wrong: a new, longer tensor every step (torch.cat) instead of writing in place."""

    def update(self, layer, k, v):
        self.k[layer] = torch.cat([self.k[layer][:, :, : self.length], k], dim=2)
        self.v[layer] = torch.cat([self.v[layer][:, :, : self.length], v], dim=2)
        return self.k[layer], self.v[layer]


class WholeBufferCache(MyCache):
    """Wrong: returns all max_len positions, so attention would also see the zeros not yet written."""

    def update(self, layer, k, v):
        super().update(layer, k, v)
        return self.k[layer], self.v[layer]


def with_pieces(model, sampler=None, cache_class=None):
    """A twin of `model` as my_engine() makes it: an Engine whose generation runs `sampler` and `cache_class`."""
    twin = GPT2(model.config)
    twin.load_state_dict(model.state_dict())
    functions = {"sampler": sampler, "kv_cache": cache_class}
    return Engine(twin.eval(), None, {name: fn for name, fn in functions.items() if fn is not None})


@pytest.mark.parametrize(
    "settings",
    [dict(eos_token_id=None), SAMPLED, dict(temperature=1.3, seed=11, eos_token_id=None)],
    ids=["greedy", "all", "plain"],
)
def test_a_learners_sampler_and_cache_give_the_engines_tokens(model, settings):
    theirs = with_pieces(model, guarded(Sampler, **MINE), guard("KVCache", MyCache))
    assert sorted(theirs.functions["sampler"].overridden()) == sorted(MINE)
    expected = llmcourse.generate(model, PROMPTS, max_new_tokens=20, **settings)
    assert llmcourse.generate(theirs, PROMPTS, max_new_tokens=20, **settings) == expected
    assert any(len(set(row)) > 3 for row in expected)  # the comparison is between varied texts


def test_beam_search_runs_on_a_learners_cache(model):
    theirs = with_pieces(model, cache_class=guard("KVCache", MyCache))
    settings = dict(max_new_tokens=12, num_beams=3, eos_token_id=None)
    assert llmcourse.generate(theirs, PROMPTS[1], **settings) == llmcourse.generate(model, PROMPTS[1], **settings)


def test_a_biased_sampler_changes_the_text(model):
    """The swap is real: a learner's sampler that picks differently gives different text."""
    biased = with_pieces(model, guarded(Sampler, sample=lambda logits, g: logits.argmax(-1)))
    assert llmcourse.generate(biased, PROMPTS[0], max_new_tokens=20, **SAMPLED) != llmcourse.generate(
        model, PROMPTS[0], max_new_tokens=20, **SAMPLED
    )


@pytest.mark.parametrize(
    "cache, message",
    [
        (GrowingCache, r"reallocated the cache: write the new keys and values into the preallocated tensors in place"),
        (
            WholeBufferCache,
            r"returned \[\(1, 2, 8, 16\), \(1, 2, 8, 16\)\], expected \(keys, values\), each of "
            r"shape \(1, 2, 3, 16\): the 3 positions filled so far",
        ),
    ],
)
def test_a_wrong_cache_is_stopped_with_a_clear_error(model, cache, message):
    theirs = with_pieces(model, cache_class=guard("KVCache", cache))
    with pytest.raises(PartError, match=r"part 'KVCache' \(" + cache.__qualname__ + r"\.update\) " + message):
        llmcourse.generate(theirs, PROMPTS[0], max_new_tokens=5, eos_token_id=None)


def test_a_cache_that_raises_or_has_the_wrong_layout_is_named():
    class Raises(MyCache):
        def update(self, layer, k, v):
            raise IndexError("boom")

    class OneTensor(MyCache):
        def __init__(self, config, batch_size, max_len, **kw):
            super().__init__(config, batch_size, max_len, **kw)
            self.k = self.k[0]

    with pytest.raises(
        PartError, match=r"Raises\.update\) raised IndexError: boom\n  hint: run the check for 'KVCache'"
    ):
        GuardedCache(Raises, CONFIG, 1, 8).update(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    with pytest.raises(
        PartError, match=r"cache\.k must be a list of 2 tensors \(one per layer\) of shape \(1, 2, 8, 16\)"
    ):
        GuardedCache(OneTensor, CONFIG, 1, 8)


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            dict(sample=lambda logits, g: logits.argmax(-1).int()),
            r"part 'sample' \(<lambda>\) returned shape \(1,\) dtype torch.int32, expected shape \(1,\) dtype "
            r"torch.int64",
        ),
        (
            dict(sample=lambda logits, g: logits.argmax(-1) + 1000),
            r"part 'sample' \(<lambda>\) returned token ids \[\d+\], expected ids in \[0, 97\)",
        ),
        (
            dict(top_k=lambda logits, k: logits[:, :k]),
            r"part 'top_k' \(<lambda>\) returned shape \(1, 40\) dtype torch.float32, expected shape \(1, 97\)",
        ),
        (dict(temperature=lambda logits, t: 1 / 0), r"part 'temperature' \(<lambda>\) raised ZeroDivisionError"),
    ],
)
def test_a_wrong_sampler_function_is_named(model, fn, message):
    theirs = with_pieces(model, guarded(Sampler, **fn))
    with pytest.raises(PartError, match=message):
        llmcourse.generate(theirs, PROMPTS[0], max_new_tokens=3, **SAMPLED)


def test_unknown_sampler_slots_are_refused():
    with pytest.raises(ValueError, match=r"unknown part 'topk'; the parts are: greedy, min_p, repetition_penalty"):
        guarded(Sampler, topk=lambda logits, k: logits)


def test_compiled_decoding_keeps_the_engines_cache(model, monkeypatch):
    """A compiled step writes the cache at a slot tensor, which only the engine's KVCache does."""
    from llmcourse.engine import generate as generation

    caches = []

    def recording_step(model):  # stands in for the compiled step: records the cache it is given
        def step(m, token, position_ids, mask, cache, slot):
            caches.append(type(cache))
            return generation.decode_step(m, token, position_ids, mask, cache, slot)

        return step

    monkeypatch.setattr(generation, "compiled_decode_step", recording_step)
    theirs = with_pieces(model, cache_class=guard("KVCache", MyCache))
    llmcourse.generate(theirs, PROMPTS[0], max_new_tokens=3, compile=True, eos_token_id=None)
    assert caches and set(caches) == {KVCache}
    assert isinstance(theirs.model.new_cache(1, 8, cache_class=theirs.functions["kv_cache"]), GuardedCache)


def test_the_engine_sampler_is_a_sampler():
    """The engine's own sample/next_token as samplers: frequencies over many seeded draws."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    settings = SamplingParams(temperature=1.0, top_p=0.8)  # keeps 0.4, 0.25, 0.2 (0.85 > 0.8)
    g = torch.Generator().manual_seed(0)
    draws = Sampler().next_token(probs.log().expand(20000, 6), settings, generator=g)
    freq = torch.bincount(draws, minlength=6) / draws.numel()
    expected = torch.tensor([0.4, 0.25, 0.2, 0, 0, 0]) / 0.85
    assert (freq - expected).abs().sum() / 2 < 0.01  # total variation; ~0.004 expected from sampling noise


# ----------------------------------------------------------------------------------------------
# The part that first broke the contract is named, in a few lines (issue 22: a top_p that removed every token
# was reported as sample's RuntimeError, after 89 lines of engine frames)


def all_removed_top_p(logits, p):
    return torch.full_like(logits, float("-inf"))


@pytest.mark.parametrize(
    "fn, message",
    [
        (
            dict(top_p=all_removed_top_p, sample=MINE["sample"]),
            r"^part 'top_p' \(all_removed_top_p\) removed every token of row 0 \(of 1\): no finite logit is left",
        ),
        (
            dict(temperature=lambda logits, t: logits * float("nan"), sample=MINE["sample"]),
            r"^part 'temperature' \(<lambda>\) returned NaN in row 0 \(of 1\)",
        ),
        (
            dict(min_p=lambda logits, p: logits.masked_fill(logits < logits.max(), float("-inf")) - float("inf")),
            r"^part 'min_p' \(<lambda>\) removed every token of row 0",
        ),
    ],
)
def test_the_processor_that_broke_the_logits_is_named_not_sample(model, fn, message):
    theirs = with_pieces(model, guarded(Sampler, **fn))
    with pytest.raises(PartError, match=message) as caught:
        llmcourse.generate(theirs, PROMPTS[0], max_new_tokens=3, **SAMPLED)
    assert "hint: run the check for" in str(caught.value)


def test_a_processor_may_remove_tokens_and_keep_rows_that_were_already_empty():
    """The contract is about what the processor did: a row the input had already emptied is not its fault."""
    top_p = guarded(Sampler, top_p=MINE["top_p"]).top_p
    logits = torch.tensor([[2.0, 1.0, -1.0], [float("-inf")] * 3])
    assert torch.isinf(top_p(logits, 0.5)[1]).all()


def test_a_part_error_shows_in_a_notebook_as_its_message_only(model):
    """IPython shows `_render_traceback_()`: the message's few lines, not the engine's frames."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    shell.user_ns.update(
        llmcourse=llmcourse,
        theirs=with_pieces(model, guarded(Sampler, top_p=all_removed_top_p, sample=MINE["sample"])),
        settings=SAMPLED,
        prompt=PROMPTS[0],
    )
    with capture_output() as shown:
        result = shell.run_cell("llmcourse.generate(theirs, prompt, max_new_tokens=3, **settings)")
    assert isinstance(result.error_in_exec, PartError)
    lines = (shown.stdout + shown.stderr).strip().splitlines()
    assert lines[0].startswith("PartError: part 'top_p' (all_removed_top_p) removed every token"), lines
    assert len(lines) <= 4 and not any("generate.py" in line for line in lines), lines


# ----------------------------------------------------------------------------------------------
# my_engine()'s Engine works where a model does (issue 22: AttributeError: 'Engine' object has no attribute 'config')


def test_my_engines_engine_works_where_a_model_does(model):
    tok = llmcourse.get_tokenizer()
    twin = with_pieces(model).model
    engine = Engine(twin, tok)
    settings = dict(max_new_tokens=6, eos_token_id=None)
    assert llmcourse.generate(engine, PROMPTS[0], **settings) == llmcourse.generate(model, PROMPTS[0], **settings)
    assert llmcourse.generate_text(engine, tok, "A:B", **settings) == llmcourse.generate_text(
        model, tok, "A:B", **settings
    )
    assert "".join(llmcourse.stream(engine, tok, "A:B", **settings)) == engine.generate_text("A:B", **settings)
    served = llmcourse.LLMEngine(engine, max_num_seqs=2, num_blocks=16, block_size=8).generate([PROMPTS[0]], **settings)
    assert served == [llmcourse.generate(model, PROMPTS[0], **settings)]
    with pytest.raises(
        TypeError, match=r"expected a model \(llmcourse.load_model\(...\)\) or my_engine\(\)'s engine, got str"
    ):
        llmcourse.generate_text("gpt2", tok, "ROMEO:")


# ----------------------------------------------------------------------------------------------
# "your engine:" lists what the run uses (issue 22: BlockAllocator and quantize_int8 for a plain generate)


def test_the_notice_lists_only_what_the_run_uses():
    from llmcourse.course.learner import ENGINE_SLOTS, TOKENIZER_SLOTS, slots_used, your_engine_notice

    everything = [n for n in ENGINE_SLOTS if n not in TOKENIZER_SLOTS] + ["StreamDecoder", "decode", "encode"]
    plain = your_engine_notice(everything, slots_used(dict(temperature=0.8, top_p=0.95)))
    assert plain == (
        "your engine: your embedding, layer_norm, linear, gelu, softmax, attention, split_heads, "
        "merge_heads, temperature, top_p, sample, KVCache, left_pad, StreamDecoder, decode, encode, the engine's own "
        "for the rest"
    )
    llama = your_engine_notice(everything, slots_used(dict(temperature=0), "llama"))
    assert llama == (
        "your engine: your embedding, linear, softmax, attention, split_heads, merge_heads, rope, rope_frequencies, "
        "rms_norm, swiglu, grouped_attention, llama_block, load_llama_checkpoint, greedy, KVCache, left_pad, the "
        "engine's own for the rest"
    )  # a Llama-family model: its own tokenizer, no layer_norm or gelu, QK-norm only for Qwen3
    assert "qk_norm" in slots_used({}, "qwen3")
    for unused in ["BlockAllocator", "quantize_int8", "verify", "greedy", "top_k", "best_k"]:
        assert unused not in plain
    assert "best_k" in slots_used(dict(draft="gpt2-shakespeare-draft", num_draft_tokens="auto"))
    assert "best_k" not in slots_used(dict(draft="gpt2-shakespeare-draft", num_draft_tokens=4))
    greedy_int8 = your_engine_notice(
        everything, slots_used(dict(temperature=0, quantize="int8", draft="prompt-lookup"))
    )
    assert {"greedy", "quantize_int8", "int8_linear", "prompt_lookup_draft", "verify"} <= set(
        greedy_int8.removeprefix("your engine: your ").split(", ")
    )
    assert "sample" not in greedy_int8 and "quantize_int4" not in greedy_int8 and "speculative_round" not in greedy_int8
    assert (
        your_engine_notice(["BlockAllocator"], slots_used({}))
        == "your engine: the engine's own parts (none of yours is used in this run)"
    )


def test_generate_parts_on_a_llama_model_names_and_runs_the_learners_llama_parts(monkeypatch, capsys, tmp_path):
    """`generate --parts ... --model llama-shakespeare`: the notice is the Llama family's (rms_norm, swiglu and the
    loader, no chapter 01 tokenizer), and the run calls exactly those learner functions: the notice said "your
    temperature" only, before the command line passed the model's type."""
    from llmcourse.course import learner
    from llmcourse.engine import parts

    from .test_cli import run_here

    calls = {name: 0 for name in ("rms_norm", "swiglu", "load_llama_checkpoint", "temperature", "encode")}

    def counted(name, fn):
        def mine(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return mine

    yours = {name: counted(name, getattr(parts, name)) for name in ("rms_norm", "swiglu", "load_llama_checkpoint")}
    yours |= {"temperature": counted("temperature", MINE["temperature"]), "encode": counted("encode", lambda *a: [])}
    monkeypatch.setattr(learner, "learner_functions", lambda *args, **kwargs: dict(yours))
    settings = ["--model", "llama-shakespeare", "--max-new-tokens", "6", "--seed", "2", "--device", "cpu", "ROMEO:"]
    code, text, notices = run_here(capsys, "generate", "--parts", str(tmp_path), *settings)
    assert code == 0, notices
    assert notices.splitlines() == [
        "your engine: your rms_norm, swiglu, load_llama_checkpoint, temperature, the engine's own for the rest"
    ]
    assert calls["load_llama_checkpoint"] == 1 and calls["rms_norm"] > 0 and calls["swiglu"] > 0
    assert calls["temperature"] == 6 and calls["encode"] == 0  # the model's own tokenizer, not chapter 01's
    assert (code, text) == run_here(capsys, "generate", *settings)[:2]  # the same answers as the engine's own


def test_the_notice_without_a_run_says_where_each_is_used():
    from llmcourse.course.learner import your_engine_notice

    notice = your_engine_notice(["gelu", "top_k", "BlockAllocator", "quantize_int8", "smooth_scales"])
    assert notice == (
        "your engine: your gelu (every generation with GPT-2); top_k (choosing tokens); BlockAllocator (LLMEngine); "
        "quantize_int8 (quantizing); smooth_scales (quantizing with a calibration (quantize_model(..., "
        "calibration=ids))); the engine's own for the rest"
    )
