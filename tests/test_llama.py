"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2, Qwen3) in the engine, proven against transformers, offline.

Each family is a random tiny configuration of transformers' own class (LlamaForCausalLM with GQA, an untied head
and Llama 3.1's "llama3" RoPE scaling; MistralForCausalLM with one KV head and a sliding window; Qwen2ForCausalLM
with q/k/v biases and a tied head; Qwen3ForCausalLM with QK-norm and a head_dim that is not n_embd / n_head),
saved with `save_pretrained` and loaded by `load_model`, as LLMs-from-scratch proves its Llama and Qwen3: nothing
is downloaded. The engine's logits must be within 1e-4 of transformers' (fp32), greedy and beam tokens equal; then
every engine mode is held to GPT-2's equivalence rules on these models: batched with left padding == alone, cached
== uncached, LLMEngine (a paged cache of n_kv_head heads, prefix caching, preemption) == alone, speculative ==
plain greedy, int8/int4 batched == alone, compiled == eager, streaming == decoding the tokens.

Measured: the largest logit difference to transformers is 1.2e-6 (llama3), 1.4e-6 (mistral, qwen3) and 1.5e-5
(qwen2, whose logits reach 50: float32's rounding of larger numbers); the assert allows 1e-4.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from llmcourse import generate, load_model
from llmcourse.engine import generate as generation
from llmcourse.engine.checkpoints import load_llama_checkpoint
from llmcourse.engine.config import CheckpointError
from llmcourse.engine.decoder import KVCache
from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.loading import save_model
from llmcourse.engine.quantize import quantize_model
from llmcourse.engine.speculative import SpeculationStats
from llmcourse.serving.llm_engine import LLMEngine

from .test_llm_engine import TOKENIZER, Tally, run_workloads

V = 97  # the tiny vocabulary: GPT-2's tokenizer reads ids 0-96 as characters (stop strings in the workloads)
COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, vocab_size=V, max_position_embeddings=128)
FAMILIES = {
    "llama3": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
            eos_token_id=[3, 5],
        ),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=4096, tie_word_embeddings=False),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    ),
}
PROMPTS = [[5, 17, 3, 60, 2, 9, 33], [41], [8, 8, 8, 12, 70, 1, 0, 96, 44, 23, 5, 5, 61]]


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of unit scale (std 1/√fan_in for matrices, 1 for the embeddings) and norms near 1, so that the
    tiny models' continuations depend on the prompt and differ from row to row (transformers' own std 0.02
    makes every logit nearly equal, and greedy choices near-ties)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                fan_in = 1 if "embed" in name else p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers' model, the engine's model loaded from the folder save_pretrained wrote, the folder)."""
    config_class, model_class, extra = FAMILIES[request.param]
    theirs = randomized(model_class(config_class(**COMMON, **extra)), seed=len(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(folder)
    return request.param, theirs, load_model(folder, device="cpu"), folder


def hf_generate(theirs, prompt: list[int], n: int, **kw) -> list[int]:
    """transformers' generate, never stopping early (its EOS ids switched off, not suppressed)."""
    config = theirs.generation_config
    eos, config.eos_token_id = config.eos_token_id, None
    try:
        ids = torch.tensor([prompt])  # the mask given: a prompt holding the pad id is not padding
        out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kw)
    finally:
        config.eos_token_id = eos
    return out[0, len(prompt) :].tolist()


def test_the_family_is_read_from_config_json(family):
    name, theirs, ours, _ = family
    assert isinstance(ours, Llama)
    cfg = ours.config
    assert cfg.model_type == theirs.config.model_type
    head_dim = 32 if name == "qwen3" else 64 // 4
    assert (cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (4, theirs.config.num_key_value_heads, head_dim)
    assert cfg.qk_norm == (name == "qwen3") and cfg.attention_bias == (name == "qwen2")
    assert cfg.tie_word_embeddings == theirs.config.tie_word_embeddings
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if name == "llama3" else None)


def test_logits_equal_transformers(family):
    _, theirs, ours, _ = family
    ids = torch.tensor([PROMPTS[0] * 4, PROMPTS[2] * 2 + [7, 7]])  # [2, 28]: past the llama3 scaling's 16
    with torch.no_grad():
        expected = theirs(ids).logits
    got = ours(ids)
    assert (got - expected).abs().max().item() < 1e-4


def test_greedy_and_beams_equal_transformers(family):
    name, theirs, ours, _ = family
    for prompt in PROMPTS:
        assert generate(ours, prompt, max_new_tokens=20, eos_token_id=None) == hf_generate(theirs, prompt, 20)
    if name in ("llama3", "qwen3"):  # beam search: two families are enough to show the cache reorders KV heads
        expected = hf_generate(theirs, PROMPTS[0], 10, num_beams=3)
        assert generate(ours, PROMPTS[0], max_new_tokens=10, num_beams=3, eos_token_id=None) == expected


def test_the_model_stops_at_any_of_its_eos_ids(family):
    name, _, ours, _ = family
    if name != "llama3":
        pytest.skip("the llama3 configuration has two EOS ids")
    assert ours.config.eos_token_ids == (3, 5)
    free = generate(ours, PROMPTS[0], max_new_tokens=40, eos_token_id=None)
    stop = next(i for i, t in enumerate(free) if t in (3, 5))  # the seeded model does emit one
    assert generate(ours, PROMPTS[0], max_new_tokens=40) == free[: stop + 1]


def test_batched_with_left_padding_equals_alone(family):
    _, _, ours, _ = family
    alone = [generate(ours, p, max_new_tokens=12, eos_token_id=None) for p in PROMPTS]
    assert generate(ours, PROMPTS, max_new_tokens=12, eos_token_id=None) == alone
    sampled = [generate(ours, p, max_new_tokens=12, eos_token_id=None, temperature=1.0, seed=3) for p in PROMPTS]
    assert sampled != alone  # sampling does sample
    assert [
        generate(ours, p, max_new_tokens=12, eos_token_id=None, temperature=1.0, seed=3) for p in PROMPTS
    ] == sampled


def test_the_cache_holds_n_kv_head_heads_and_equals_no_cache(family):
    _, _, ours, _ = family
    ids = torch.tensor([PROMPTS[2]])  # [1, 13]
    full = ours(ids)[0]  # [13, V]
    cache = ours.new_cache(1, 32)
    assert isinstance(cache, KVCache) and cache.k[0].shape == (1, ours.config.n_kv_head, 32, ours.config.head_dim)
    steps = [ours(ids[:, :6], cache=cache)[0]] + [ours(ids[:, t : t + 1], cache=cache)[0] for t in range(6, 13)]
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4  # logits up to ~20: float32 rounding, ~1e-5


def test_streaming_text_is_the_decoded_tokens(family):
    _, _, ours, _ = family
    prompt = "A"  # GPT-2's tokenizer reads ids 0-93 as single printable characters (id 32)
    tokens = generate(ours, TOKENIZER.encode(prompt), max_new_tokens=15, eos_token_id=None)
    pieces = list(generation.stream(ours, TOKENIZER, prompt, max_new_tokens=15, eos_token_id=None))
    assert len(pieces) > 1 and "".join(pieces) == TOKENIZER.decode(tokens)


def test_llm_engine_gives_every_request_its_alone_tokens(family):
    """The same random workloads as GPT-2's property test (arrivals, shared prefixes, preemption in pools just
    big enough, chunked prefills, sampling, EOS and stop strings), on this family."""
    _, _, ours, _ = family
    tally = Tally()
    run_workloads(range(300, 310), lambda seed: ours, tally, tokenizer=TOKENIZER)
    assert tally.workloads == 10 and tally.preempted >= 1 and tally.cached >= 1, tally


def tiny_llama(seed: int) -> Llama:
    """A random tiny model of a random family: 1-4 KV heads under 2-8 query heads, QK-norm, biases, tied or not."""
    rng = random.Random(seed)
    n_kv_head = rng.choice([1, 2])
    n_head = n_kv_head * rng.choice([1, 2, 4])
    model_type = rng.choice(["llama", "mistral", "qwen2", "qwen3"])
    config = LlamaConfig(
        n_layer=rng.choice([1, 2]),
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_head * 8,
        intermediate_size=rng.choice([24, 40]),
        n_positions=128,
        vocab_size=rng.choice([61, 97]),
        qk_norm=model_type == "qwen3",
        attention_bias=model_type == "qwen2",
        tie_word_embeddings=rng.random() < 0.5,
        head_dim=rng.choice([None, 16]),
        model_type=model_type,
    )
    return randomized(Llama(config).init_weights(seed), seed).requires_grad_(False)


def test_llm_engine_on_random_families_and_head_counts():
    tally = Tally()
    run_workloads(range(400, 430), tiny_llama, tally, tokenizer=TOKENIZER)
    assert tally.workloads == 30 and tally.preempted >= 3 and tally.cached >= 3 and tally.stop >= 1, tally


def test_speculative_decoding_gives_plain_greedy_tokens(family, tmp_path):
    name, theirs, ours, _ = family
    one_layer = {**theirs.config.to_dict(), "num_hidden_layers": 1}
    one_layer.pop("layer_types", None)  # Qwen's per-layer list, one entry per layer
    draft_hf = randomized(type(theirs)(type(theirs.config)(**one_layer)), seed=9)
    draft_hf.save_pretrained(tmp_path)
    draft = load_model(tmp_path, device="cpu")
    for prompt in PROMPTS:
        plain = generate(ours, prompt, max_new_tokens=16, eos_token_id=None)
        stats = SpeculationStats()
        assert (
            generate(ours, prompt, max_new_tokens=16, eos_token_id=None, draft=draft, num_draft_tokens=3, stats=stats)
            == plain
        )
        assert generate(ours, prompt * 3, max_new_tokens=16, eos_token_id=None, draft="prompt-lookup") == generate(
            ours, prompt * 3, max_new_tokens=16, eos_token_id=None
        )
    sampled = dict(max_new_tokens=16, eos_token_id=None, temperature=0.8, seed=5)
    a = generate(ours, PROMPTS[0], draft=draft, **sampled)
    assert a == generate(ours, PROMPTS[0], draft=draft, **sampled)  # seeded: reproducible


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_models_are_exact_in_every_mode_and_close_to_float(family, fmt, tmp_path):
    _, _, ours, folder = family
    q = load_model(folder, device="cpu", quantize=fmt)
    ids = torch.tensor([PROMPTS[0] * 3])
    float_logits, q_logits = ours(ids), q(ids)
    # int4's error on random unit-scale weights: a few percent of the logits' spread
    assert (q_logits - float_logits).abs().max() < (0.05 if fmt == "int8" else 0.3) * float_logits.std() * 10
    alone = [generate(q, p, max_new_tokens=10, eos_token_id=None) for p in PROMPTS]
    assert generate(q, PROMPTS, max_new_tokens=10, eos_token_id=None) == alone
    engine = LLMEngine(q, block_size=4, num_blocks=12)
    assert engine.generate(PROMPTS, max_new_tokens=10, eos_token_id=None) == alone
    save_model(q, tmp_path / "q")
    again = load_model(tmp_path / "q", device="cpu")
    assert generate(again, PROMPTS, max_new_tokens=10, eos_token_id=None) == alone


def test_compiled_decoding_equals_eager(family, monkeypatch):
    """compile=True's static-shape step (the slot, the whole-cache mask), compiled on dynamo's eager backend."""
    _, _, ours, _ = family
    step = torch.compile(generation.decode_step, backend="eager", dynamic=False)
    monkeypatch.setitem(generation._compiled, "cpu", step)
    eager = generate(ours, PROMPTS, max_new_tokens=10, eos_token_id=None)
    assert generate(ours, PROMPTS, max_new_tokens=10, eos_token_id=None, compile=True) == eager


def test_save_model_writes_what_transformers_loads_and_shards_load(family, tmp_path):
    _, theirs, ours, _ = family
    save_model(ours, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(back(ids).logits, theirs(ids).logits)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    assert torch.equal(load_model(tmp_path / "sharded", device="cpu")(ids), ours(ids))


def test_load_llama_checkpoint_names_and_ties(family):
    name, theirs, _, folder = family
    state, config = load_llama_checkpoint(folder)
    assert "embed_tokens.weight" in state and "layers.1.mlp.down_proj.weight" in state
    assert not any(k.startswith("model.") for k in state)
    assert ("lm_head.weight" in state) == (not theirs.config.tie_word_embeddings)
    assert config["model_type"] == theirs.config.model_type


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope scaling 'yarn' is not supported"),
        ({"num_key_value_heads": 3}, r"n_head \(4\) must be a multiple of n_kv_head \(3\)"),
        ({"mlp_bias": True}, r"mlp_bias=true is not supported"),
    ],
)
def test_configs_the_engine_does_not_run_are_refused(family, tmp_path, change, message):
    name, theirs, _, folder = family
    if name != "qwen3":
        pytest.skip("one family is enough")
    raw = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    (tmp_path / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path, device="cpu")


def test_a_sliding_window_caps_the_context():
    raw = transformers.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=1, sliding_window=32)
    assert LlamaConfig.from_dict(raw.to_dict()).n_positions == 32


def test_quantize_model_keeps_the_untied_head_and_table_apart():
    model = tiny_llama(3)
    while model.config.tie_word_embeddings:
        model = tiny_llama(model.config.vocab_size + 1)
    quantize_model(model, "int8")
    assert model.lm_head.qweight.shape == (model.config.vocab_size, model.config.n_embd)
    assert model.embed_tokens.qweight.shape == (model.config.vocab_size, model.config.n_embd)


def test_a_hub_name_loads_a_sharded_snapshot_from_the_local_cache_offline(family, tmp_path, monkeypatch):
    """A Hub name resolves to huggingface_hub's cache (shards, index and generation_config included), offline."""
    name, theirs, ours, _ = family
    if name != "llama3":
        pytest.skip("one family is enough")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "models--someone--tiny-llama"
    theirs.save_pretrained(repo / "snapshots" / commit, max_shard_size="40KB")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    model = load_model("someone/tiny-llama", device="cpu")
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(model(ids), ours(ids)) and model.config.eos_token_ids == (3, 5)
