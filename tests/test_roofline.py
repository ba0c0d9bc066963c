"""The roofline's counts (llmcourse.engine.roofline, chapter 10) against independent references: torch's FLOP
counter on the engine's real forward pass, the parameters of the engine's GPT-2 and of transformers' Llama, and
the bytes the engine's quantized layers store."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmcourse import GPT2, GPT2Config
from llmcourse.engine.quantize import quantize_model
from llmcourse.engine.roofline import (
    GPUS,
    SHAPES,
    ModelShape,
    Roofline,
    card_of,
    critical_batch,
    gpu_roof,
    matrix_bytes,
    predict,
    roofline_time,
    step_cost,
    utilization,
)

CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=500, n_positions=64)


def decode_flops(hf, batch, context):
    """torch's count, by op, of the FLOPs of one decode step of transformers' `hf` after `context` positions."""
    with torch.no_grad():
        past = hf(torch.zeros(batch, context, dtype=torch.long), use_cache=True).past_key_values if context else None
        with FlopCounterMode(display=False) as counter:
            hf(torch.zeros(batch, 1, dtype=torch.long), past_key_values=past, use_cache=True)
    return counter.get_flop_counts()["Global"]


@pytest.mark.parametrize("batch, context", [(1, 7), (3, 20), (2, 0)])
def test_decode_flops_equal_torchs_flop_counter_on_transformers_gpt2(batch, context):
    """Every matrix product and attention's two, as torch counts them in transformers' GPT-2 (eager attention, whose
    products torch sees) decoding with a cache."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel(
        HFConfig(n_layer=2, n_head=4, n_embd=64, vocab_size=500, n_positions=64, attn_implementation="eager")
    ).eval()
    counted = decode_flops(hf, batch, context)
    cost = step_cost(ModelShape.of(CONFIG), batch, 1, context, "float32", "float32")
    assert cost.flops == sum(counted.values())
    # the engine's own step does the same matrix products (its attention is one fused op torch does not count)
    model = GPT2(CONFIG).init_weights(0).eval()
    cache = model.new_cache(batch, context + 1)
    with torch.no_grad():
        if context:
            model(torch.zeros(batch, context, dtype=torch.long), cache=cache)
        with FlopCounterMode(display=False) as counter:
            model(torch.zeros(batch, 1, dtype=torch.long), cache=cache)
    matrices = {str(op): n for op, n in counted.items() if "bmm" not in str(op)}
    assert counter.get_total_flops() == sum(matrices.values())


def test_a_prefill_counts_causal_pairs_what_its_decode_steps_would():
    """T new positions attend to T(T+1)/2 (query, key) pairs, not T²: a prefill of 10 does the FLOPs of 10 decode
    steps over growing contexts."""
    shape = ModelShape.of(CONFIG)
    assert step_cost(shape, 1, 10, 0).flops == sum(step_cost(shape, 1, 1, ctx).flops for ctx in range(10))


def test_gpt2_matrices_are_the_engines_weights_less_biases_norms_and_positions():
    model = GPT2(GPT2Config())
    small = sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias") or ".ln" in n or "ln_f" in n)
    rest = sum(p.numel() for p in model.parameters()) - small - model.wpe.weight.numel()
    assert ModelShape.of(GPT2Config()).resident_params() == rest == 123_532_032
    assert step_cost(SHAPES["GPT-2 124M"], 1, 1, 0, "float32", "float32").weights == 4 * rest


@pytest.mark.parametrize("name", ["Llama-2-7B", "Llama-3-8B", "Llama-3.2-1B"])
def test_llama_shapes_hold_transformers_parameters_less_norms(name):
    """transformers' LlamaForCausalLM with the published configuration (built on the meta device: no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[name]
    config = LlamaConfig(
        hidden_size=s.n_embd,
        intermediate_size=s.d_ff,
        num_hidden_layers=s.n_layer,
        num_attention_heads=s.n_head,
        num_key_value_heads=s.n_kv_head,
        head_dim=s.head_dim,
        vocab_size=s.vocab_size,
        tie_word_embeddings=s.tied,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert s.resident_params() == sum(p.numel() for p in model.parameters()) - norms


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_matrix_bytes_are_what_the_engines_quantized_layers_store(fmt):
    model = quantize_model(GPT2(CONFIG).init_weights(0), fmt)
    layers = [m for m in model.modules() if hasattr(m, "qweight")]
    assert layers
    for layer in layers:
        stored = layer.qweight.nbytes + layer.scales.nbytes
        rows, cols = layer.scales.shape[0], (layer.qweight.shape[1] * (2 if fmt == "int4" else 1))
        assert matrix_bytes(rows, cols, fmt, "float32") == stored


def test_roofline_time_picks_the_larger_time_and_memory_on_a_tie():
    assert roofline_time(10, 10, peak_flops=1, bandwidth=1) == (10, "memory", 1.0, 1.0)
    assert roofline_time(30, 10, peak_flops=1, bandwidth=2).bound == "compute"
    assert roofline_time(30, 10, peak_flops=1, bandwidth=2).seconds == 30


def test_critical_batch_is_the_first_compute_bound_batch():
    shape, args = SHAPES["Llama-3-8B"], ("bfloat16", "bfloat16", *gpu_roof("H100 SXM"))

    def bound(b):
        cost = step_cost(shape, b, 1, 0, "bfloat16", "bfloat16")
        return roofline_time(cost.flops, cost.bytes, *gpu_roof("H100 SXM")).bound

    b = critical_batch(shape, 0, *args)
    assert bound(b) == "compute" and bound(b - 1) == "memory"
    assert critical_batch(shape, 0, *args, max_batch=b - 1) is None
    assert critical_batch(shape, 8192, *args) is None  # the caches' bytes grow as fast as the FLOPs


def test_utilization_and_predict():
    assert utilization(2e9, 1e9, 0.01, 1e12, 2e11) == (0.5, 0.2)
    p = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), measured_seconds=0.01)
    assert p.roof.bound == "memory" and math.isclose(p.tokens_per_s, 1 / p.seconds)
    assert math.isclose(p.mbu, p.cost.bytes / 0.01 / 3.35e12)
    swapped = Roofline().replace(step_cost=lambda *a: step_cost(*a)._replace(kv_cache=0.0))
    assert predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), context=8192, table=swapped).seconds < p.seconds


def test_datasheets_are_dense_figures_and_cards_are_recognised():
    for card in GPUS.values():
        if card.peak_flops is not None:
            assert card.sparse_flops == pytest.approx(2 * card.peak_flops, rel=0.01)
    assert card_of("NVIDIA H200") == "H200 SXM" and card_of("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert card_of("NVIDIA A100-SXM4-40GB") is None and card_of("Tesla T4") is None
    with pytest.raises(ValueError, match="unknown card"):
        gpu_roof("H100 PCIe")
