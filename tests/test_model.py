"""The forward pass against transformers' GPT2LMHeadModel, the KV cache, and swappable parts."""

import pytest
import torch
import torch.nn.functional as F

from llmcourse import GPT2, GPT2Config, PartError, Parts
from llmcourse.course.guards import guarded
from llmcourse.engine.parts import attention, attention_with_softmax

from .conftest import DEVICES, hf_twin

TOLERANCE = 1e-4  # max abs difference of fp32 logits from transformers'

CONFIGS = {
    "gpt2-124M": GPT2Config(),
    "tiny": GPT2Config(n_layer=1, n_head=1, n_embd=16, n_positions=32, vocab_size=100),
    "small": GPT2Config(n_layer=3, n_head=4, n_embd=64, n_positions=128, vocab_size=1000),
    "odd-heads": GPT2Config(n_layer=2, n_head=3, n_embd=48, n_positions=64, vocab_size=50257),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_equal_transformers(name, tmp_path):
    config = CONFIGS[name]
    ours = GPT2(config).init_weights(seed=7).eval()
    theirs = hf_twin(ours, tmp_path)
    ids = torch.randint(
        0, config.vocab_size, (2, min(64, config.n_positions)), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    assert got.shape == (2, ids.shape[1], config.vocab_size)
    diff = (got - expected).abs().max().item()
    assert diff < TOLERANCE, f"{name}: max |logit difference| = {diff:.2e}"
    assert expected.std() > 0.05  # the comparison is not between near-zero tensors


def test_lively_logits_equal_transformers(small_pair):
    ours, theirs = small_pair
    ids = torch.randint(0, 50257, (3, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    assert diff < TOLERANCE * 10  # logits here are ~100x larger than GPT-2's; 1e-3 absolute is 1e-6 relative


@pytest.mark.parametrize("device", DEVICES)
def test_cached_decode_equals_full_forward(small_pair, device):
    model = small_pair[0].to(device)
    ids = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(3)).to(device)
    with torch.inference_mode():
        full = model(ids)
        cache = model.new_cache(batch_size=2, max_len=40)
        pieces = [model(ids[:, :25], cache=cache)]  # prefill
        pieces += [model(ids[:, t : t + 1], cache=cache) for t in range(25, 40)]  # decode, one at a time
    assert cache.length == 40
    assert (torch.cat(pieces, dim=1) - full).abs().max().item() < 1e-3
    model.to("cpu")


def test_left_padding_with_mask_equals_unpadded(small_pair):
    model = small_pair[0]
    ids = torch.randint(0, 50257, (1, 12), generator=torch.Generator().manual_seed(4))
    pad = 5
    padded = torch.cat([torch.full((1, pad), 50256), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        alone = model(ids)
        batched = model(padded, attention_mask=mask, position_ids=positions)[:, pad:]
    assert torch.isfinite(batched).all()
    assert (batched - alone).abs().max().item() < 1e-3


def test_cache_overflow_is_an_error(small_pair):
    model = small_pair[0]
    cache = model.new_cache(batch_size=1, max_len=4)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)


def my_gelu(x):
    """GELU written out, differently from torch's, as a learner might."""
    return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)))


def my_layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def my_softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def test_swapped_parts_give_the_same_logits(small_pair):
    model = small_pair[0]
    ids = torch.randint(0, 50257, (2, 30), generator=torch.Generator().manual_seed(5))
    calls = []

    def counting_softmax(x, dim=-1):
        calls.append(x.shape)
        return my_softmax(x, dim)

    with torch.inference_mode():
        reference = model(ids)
        model.parts = guarded(
            Parts, gelu=my_gelu, layer_norm=my_layer_norm, softmax=counting_softmax, embedding=lambda w, i: w[i]
        )
        try:
            swapped = model(ids)
        finally:
            model.parts = Parts()
    assert len(calls) == model.config.n_layer  # the swapped-in softmax really ran, once per layer
    assert (swapped - reference).abs().max().item() < 1e-3
    assert guarded(Parts, gelu=my_gelu).overridden() == ["gelu"]


def test_swapped_in_attention_reads_no_mask_as_no_mask(small_pair):
    """A learner's attention follows torch's convention (mask=None: attend everywhere); the model gives
    it the causal mask, so the logits stay those of GPT-2, with and without padding."""
    model = small_pair[0]
    calls = []

    def plain_attention(q, k, v, mask=None):
        calls.append(mask is None)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return my_softmax(scores) @ v

    ids = torch.randint(0, 50257, (2, 12), generator=torch.Generator().manual_seed(7))
    padding = torch.ones(2, 12, dtype=torch.long)
    padding[1, :4] = 0
    with torch.inference_mode():
        reference = [model(ids), model(ids, attention_mask=padding)]
        model.parts = guarded(Parts, attention=plain_attention)
        try:
            swapped = [model(ids), model(ids, attention_mask=padding)]
        finally:
            model.parts = Parts()
    assert calls and not any(calls)
    for mine, theirs in zip(swapped, reference):
        assert (mine - theirs).abs().max().item() < 1e-3


def test_written_out_attention_equals_fused():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    assert torch.allclose(attention_with_softmax(q, k, v), attention(q, k, v), atol=1e-6)
    q1 = q[:, :, -2:]  # two queries at the end: causal w.r.t. the last positions
    assert torch.allclose(attention(q1, k, v), attention(q, k, v)[:, :, -2:], atol=1e-6)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(attention(q, k, v), reference)


@pytest.mark.parametrize(
    "part, broken, message",
    [
        ("gelu", lambda x: x[..., :-1], r"part 'gelu'.*shape .* expected shape"),
        ("gelu", lambda x: x.double(), r"part 'gelu'.*dtype torch.float64.*expected .*torch.float32"),
        ("gelu", lambda x: x.tolist(), r"part 'gelu'.*returned list, expected a torch.Tensor"),
        ("softmax", lambda x, dim=-1: 1 / 0, r"(?s)part 'softmax'.*raised ZeroDivisionError.*hint"),
        ("layer_norm", lambda x, w, b, eps: None, r"part 'layer_norm'.*returned NoneType"),
    ],
)
def test_broken_parts_fail_with_a_clear_error(small_pair, part, broken, message):
    model = small_pair[0]
    model.parts = guarded(Parts, **{part: broken})
    try:
        with torch.inference_mode(), pytest.raises(PartError, match=message):
            model(torch.tensor([[1, 2, 3]]))
    finally:
        model.parts = Parts()


def test_unknown_part_name_lists_the_parts():
    with pytest.raises(ValueError, match="unknown part 'gleu'.*gelu"):
        guarded(Parts, gleu=my_gelu)
    with pytest.raises(ValueError, match="must be a function"):
        guarded(Parts, gelu=3)


@pytest.mark.parametrize("device", DEVICES)
def test_device_and_dtype(small_folder, device):
    from llmcourse import load_model

    model = load_model(small_folder, device=device)
    assert model.device.type == device and model.dtype == torch.float32
    half = load_model(small_folder, device=device, dtype="bfloat16")
    ids = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(8)).to(device)
    with torch.inference_mode():
        full, low = model(ids), half(ids).float()
    # bf16 keeps ~3 significant digits: the two agree on the most likely next token almost everywhere
    agree = (full.argmax(-1) == low.argmax(-1)).float().mean().item()
    assert agree >= 0.9
