"""RoPE as checkpoints ship it (issue 43): the `rope_frequencies` part equals transformers' ROPE_INIT_FUNCTIONS
("default", "linear", "llama3"), and `Llama.rotation` never bypasses the learner's `rope` or `rope_frequencies`.

On a tiny Llama with rope_scaling (test_llama's llama3 family, and the same with "linear"), saved by transformers and
loaded by the engine: a do-nothing `rope` or an unscaled `rope_frequencies` changes the logits; chapter 02's
half-split `rope` as a learner writes it (angles from float positions) composed with the engine's frequencies gives
the engine's logits (measured: equal to the last bit; asserted within 1e-6) and transformers' (measured 1.8e-6 with
llama3, 1.2e-6 with linear, as the engine's own; asserted within 1e-4, as test_llama). Measured changes: a
do-nothing `rope` moves the logits by 1.7 (llama3) and 1.2 (linear), unscaled frequencies by 2.4 and 1.5.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from llmcourse import generate, load_model
from llmcourse.course.guards import guarded
from llmcourse.engine import positions
from llmcourse.engine.parts import Parts, rope_frequencies
from llmcourse.engine.slots import PartError

from .test_llama import COMMON, FAMILIES, PROMPTS, randomized

LLAMA3_2_1B = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
FREQUENCY_CASES = {  # (head_dim, rope_theta, rope_scaling)
    "Llama-3.2-1B": (64, 500000.0, {"rope_type": "llama3", **LLAMA3_2_1B}),
    "Llama-3.1-8B (factor 8)": (128, 500000.0, {"rope_type": "llama3", **LLAMA3_2_1B, "factor": 8.0}),
    "llama3, test_llama's tiny": (16, 10000.0, FAMILIES["llama3"][2]["rope_scaling"]),
    "linear 4": (64, 10000.0, {"rope_type": "linear", "factor": 4.0}),
    "linear 2.5": (32, 1e6, {"rope_type": "linear", "factor": 2.5}),
    "default": (64, 10000.0, None),
    "default, Qwen's theta": (128, 1e6, {"rope_type": "default"}),
}


def transformers_frequencies(head_dim: int, theta: float, scaling) -> torch.Tensor:
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_theta=theta, rope_scaling=scaling
    )
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config, device="cpu")[0]
    return ROPE_INIT_FUNCTIONS[kind](config, "cpu")[0]


@pytest.mark.parametrize("case", list(FREQUENCY_CASES))
def test_rope_frequencies_equal_transformers(case):
    head_dim, theta, scaling = FREQUENCY_CASES[case]
    ours = rope_frequencies(head_dim, theta, scaling)
    assert ours.dtype == torch.float64 and ours.shape == (head_dim // 2,)
    theirs = transformers_frequencies(head_dim, theta, scaling)  # float32: equal up to its rounding
    torch.testing.assert_close(ours, theirs.double(), rtol=1e-6, atol=0)
    if case.startswith("Llama-3"):  # the three regimes present: pairs kept, blended and divided by the factor
        ratio = positions.rope_inv_freq(head_dim, theta) / ours
        kept, divided = ratio == 1, ratio == scaling["factor"]
        assert kept.any() and divided.any() and (~kept & ~divided).any()


# -- the engine never bypasses the learner's parts on a rope_scaling checkpoint -----------------------------------

SCALINGS = {
    "llama3": FAMILIES["llama3"][2]["rope_scaling"],  # original 16: the 28-token prompt is past it
    "linear": {"rope_type": "linear", "factor": 4.0},
}


def saved(scaling, seed: int, folder):
    """(transformers' LlamaForCausalLM with this rope_scaling, the engine's model loaded from its save_pretrained)."""
    extra = {**FAMILIES["llama3"][2], "rope_scaling": scaling}
    theirs = randomized(transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, **extra)), seed=seed)
    theirs.save_pretrained(folder)
    return theirs, load_model(folder, device="cpu")


@pytest.fixture(scope="module", params=list(SCALINGS))
def scaled(request, tmp_path_factory):
    theirs, ours = saved(SCALINGS[request.param], 11, tmp_path_factory.mktemp(request.param))
    assert ours.config.rope_scaling["rope_type"] == request.param
    return theirs, ours


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory):
    theirs, ours = saved(None, 12, tmp_path_factory.mktemp("unscaled"))
    assert ours.config.rope_scaling is None
    return ours


IDS = torch.tensor([PROMPTS[0] * 4, PROMPTS[2] * 2 + [7, 7]])  # [2, 28]


def learner_rope(x, position_ids, base=10000.0):
    """Chapter 02's half-split RoPE as a learner writes it: the angles from the positions as they come (ints, or
    chapter 11's float angles), in float64."""
    d = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = position_ids[..., None].double() * inv_freq  # [B, T, D/2]
    angle = torch.cat([angle, angle], dim=-1)[:, None]  # [B, 1, T, D]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * angle.cos().to(x.dtype) + torch.cat([-x2, x1], dim=-1) * angle.sin().to(x.dtype)


def logits_with(model, **parts) -> torch.Tensor:
    own = model.parts
    model.parts = guarded(Parts, **parts)
    try:
        with torch.inference_mode():
            return model(IDS)
    finally:
        model.parts = own


def test_a_do_nothing_rope_changes_a_scaled_checkpoints_logits(scaled):
    _, ours = scaled
    with torch.inference_mode():
        engine = ours(IDS)
    assert (logits_with(ours, rope=lambda x, position_ids, base=10000.0: x) - engine).abs().max() > 0.1


@pytest.mark.parametrize(
    "wrong",
    [
        lambda head_dim, theta, scaling: positions.rope_inv_freq(head_dim, theta),  # the scaling forgotten
        lambda head_dim, theta, scaling: positions.rope_inv_freq(head_dim, theta) / scaling.get("factor", 1.0) ** 0.5,
    ],
    ids=["unscaled", "another rule"],
)
def test_a_wrong_scaling_rule_changes_the_logits(scaled, wrong):
    _, ours = scaled
    with torch.inference_mode():
        engine = ours(IDS)
    assert (logits_with(ours, rope_frequencies=wrong) - engine).abs().max() > 0.01
    assert (logits_with(ours, rope_frequencies=wrong, rope=learner_rope) - engine).abs().max() > 0.01


def test_the_learners_rope_with_the_engines_frequencies_equals_the_engine_and_transformers(scaled):
    theirs, ours = scaled
    with torch.inference_mode():
        engine, expected = ours(IDS), theirs(IDS).logits
    mine = logits_with(ours, rope=learner_rope)
    assert (mine - engine).abs().max().item() <= 1e-6
    assert (mine - expected).abs().max().item() < 1e-4
    also = logits_with(ours, rope=learner_rope, rope_frequencies=lambda *args: rope_frequencies(*args).clone())
    assert (also - engine).abs().max().item() <= 1e-6
    prompt = PROMPTS[2]  # decoding: positions past the prompt, each step's angles through the learner's rope
    ours.parts = guarded(Parts, rope=learner_rope)
    try:
        tokens = generate(ours, prompt, max_new_tokens=12, eos_token_id=None)
    finally:
        ours.parts = Parts()
    assert tokens == generate(ours, prompt, max_new_tokens=12, eos_token_id=None)


def test_unscaled_a_learners_rope_is_called_as_chapter_02_calls_it_and_frequencies_still_count(unscaled):
    seen = []

    def recording(x, position_ids, base=10000.0):
        seen.append(position_ids.dtype)
        return learner_rope(x, position_ids, base)

    model = unscaled
    with torch.inference_mode():
        engine = model(IDS)
    assert (logits_with(model, rope=recording) - engine).abs().max().item() <= 1e-6
    assert set(seen) == {torch.long}  # the positions themselves, as chapter 02's check gives them
    seen.clear()
    doubled = logits_with(model, rope=recording, rope_frequencies=lambda d, theta, s: 2 * rope_frequencies(d, theta, s))
    assert set(seen) == {torch.float64} and (doubled - engine).abs().max() > 0.01  # composed with the angles


# -- the guards ---------------------------------------------------------------------------------------------------


def test_a_rope_that_fails_on_float_positions_is_told_why_it_gets_them(scaled):
    _, ours = scaled

    def table_rope(x, position_ids, base=10000.0):  # a cos/sin table indexed by position
        d = x.shape[-1]
        angle = torch.arange(64, dtype=torch.float64)[:, None] / base ** (torch.arange(0, d, 2) / d)
        angle = torch.cat([angle, angle], dim=-1)
        cos, sin = angle.cos()[position_ids][:, None].float(), angle.sin()[position_ids][:, None].float()
        return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin

    with pytest.raises(PartError, match=r"part 'rope'[\s\S]*chapter 11 calls rope with angles as float positions"):
        logits_with(ours, rope=table_rope)


def test_the_guards_name_the_new_slots_and_chapter_11():
    q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    with pytest.raises(
        PartError, match=r"part 'grouped_attention'[\s\S]*expected shape \(1, 4, 3, 8\)[\s\S]*chapter 11"
    ):
        guarded(
            Parts, grouped_attention=lambda q, k, v, mask, attention: attention(q[:, :2], k, v, mask)
        ).grouped_attention(q, k, k, None, Parts.attention)
    frequencies = guarded(Parts, rope_frequencies=lambda d, theta, s: rope_frequencies(d, theta, s).float())
    with pytest.raises(PartError, match=r"part 'rope_frequencies'[\s\S]*dtype torch\.float64[\s\S]*chapter 11"):
        frequencies.rope_frequencies(8, 10000.0, None)
    scaling = {"rope_type": "linear", "factor": 2.0}
    guarded(
        Parts, rope_frequencies=lambda d, theta, s: s.pop("factor") and rope_frequencies(d, theta, None)
    ).rope_frequencies(8, 10000.0, scaling)
    assert scaling == {"rope_type": "linear", "factor": 2.0}  # the learner's function got a copy
