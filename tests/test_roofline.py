"""The roofline's counts (llmcourse.engine.roofline, chapter 10) against independent references: torch's FLOP
counter on the engine's forward passes and on transformers' GPT-2 and Llama, the parameters of the engine's GPT-2 and
of transformers' Llama, the tensors the engine's layers store and produce, the engine's KV cache, and a brute-force
search for the critical batch."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmcourse import GPT2, GPT2Config
from llmcourse.course.guards import guard
from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.parts import Parts, attention_with_softmax
from llmcourse.engine.quantize import quantize_model
from llmcourse.engine.roofline import (
    GPUS,
    SHAPES,
    ModelShape,
    Roofline,
    RooflineTime,
    StepTime,
    attention_cost,
    card_of,
    critical_batch,
    gemm_cost,
    gpu_roof,
    predict,
    roofline_time,
    step_kernels,
    step_time,
    utilization,
)
from llmcourse.engine.slots import PartError

CONFIG = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=500, n_positions=64)
# grouped-query attention: 4 query heads share 2 KV heads; an untied head
LLAMA = LlamaConfig(
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    n_embd=64,
    intermediate_size=96,
    vocab_size=500,
    n_positions=64,
    tie_word_embeddings=False,
)
GEMMS = ("q", "k", "v", "o", "gate", "up", "down", "head")
# (batch, context, new tokens): decode steps after a cache, a prefill into an empty cache, a chunk after a cache
STEPS = [(1, 7, 1), (3, 20, 1), (2, 0, 5), (2, 4, 3)]


def counted(forward, batch: int, context: int, new: int) -> dict[str, int]:
    """torch's FLOP count of `forward(ids, past)` on `new` tokens per sequence after `context` cached ones, split
    into the weight products (mm, addmm) and attention's (bmm: the scores and the weighted sum)."""
    with torch.no_grad():
        past = forward(torch.zeros(batch, context, dtype=torch.long), None) if context else None
        with FlopCounterMode(display=False) as counter:
            forward(torch.zeros(batch, new, dtype=torch.long), past)
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"aten.mm", "aten.addmm", "aten.bmm"}, ops
    return {"products": ops.get("aten.mm", 0) + ops.get("aten.addmm", 0), "attention": ops.get("aten.bmm", 0)}


def engine_forward(model, batch: int, context: int, new: int):
    """The engine's step through its own KV cache (one cache for the prefill and the step)."""
    cache = model.new_cache(batch, context + new)
    return lambda ids, past: model(ids, cache=cache)


def transformers_forward(hf):
    def forward(ids, past):
        out = hf(ids, past_key_values=past, use_cache=True)
        return out.past_key_values

    return forward


def masked_pairs(shape: ModelShape, batch: int, new: int) -> int:
    """FLOPs of the (query, key) pairs a causal mask removes from a dense product of `new` queries: a dense
    implementation computes the scores and weighted sums of new(new - 1)/2 pairs per query head that
    `attention_cost` (which counts what a causal kernel needs) leaves out."""
    return 4 * shape.n_layer * shape.n_head * shape.head_dim * batch * (new * (new - 1) // 2)


def assert_counts(shape: ModelShape, got: dict, batch: int, context: int, new: int) -> None:
    kernels = {k.name: k.flops for k in step_kernels(shape, batch, new, context, "float32", "float32")}
    assert got["products"] == sum(kernels[name] for name in GEMMS if name in kernels)
    assert got["attention"] == kernels["attention"] + masked_pairs(shape, batch, new)
    assert kernels["elementwise"] == 0  # norms, residuals, activations: FLOPs not counted, as torch's counter


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("batch, context, new", STEPS)
def test_flops_equal_torchs_flop_counter_on_the_engines_forward(family, batch, context, new):
    """The engine's GPT-2 and GQA Llama with the written-out attention (whose products torch's counter sees; the
    fused kernel's it does not): the weight products are step_kernels' GEMMs, attention its attention kernel."""
    written_out = Parts().replace(attention=attention_with_softmax)
    model = (GPT2(CONFIG, written_out) if family == "gpt2" else Llama(LLAMA, written_out)).init_weights(0).eval()
    got = counted(engine_forward(model, batch, context, new), batch, context, new)
    assert_counts(ModelShape.of(model.config), got, batch, context, new)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("batch, context, new", STEPS)
def test_flops_equal_torchs_flop_counter_on_transformers(family, batch, context, new):
    """transformers' GPT-2 and Llama (eager attention, grouped-query for Llama: each query head's products
    counted, the KV heads repeated), decoding with a cache and prefilling."""
    import transformers

    if family == "gpt2":
        hf = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                n_layer=2, n_head=4, n_embd=64, vocab_size=500, n_positions=64, attn_implementation="eager"
            )
        )
        shape = ModelShape.of(CONFIG)
    else:
        hf = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=500,
                max_position_embeddings=64,
                tie_word_embeddings=False,
                attn_implementation="eager",
            )
        )
        shape = ModelShape.of(LLAMA)
    got = counted(transformers_forward(hf.eval()), batch, context, new)
    assert_counts(shape, got, batch, context, new)


def test_a_prefill_counts_causal_pairs_what_its_decode_steps_would():
    """T new positions attend to T(T+1)/2 (query, key) pairs, not T²: a prefill of 10 does the attention FLOPs of 10
    decode steps over growing contexts; after a context, the same holds from there."""
    shape = ModelShape.of(LLAMA)
    assert attention_cost(shape, 3, 10, 0).flops == sum(attention_cost(shape, 3, 1, c).flops for c in range(10))
    assert attention_cost(shape, 1, 4, 6).flops == sum(attention_cost(shape, 1, 1, c).flops for c in range(6, 10))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemm_bytes_are_what_the_engines_layers_store_read_and_write(fmt, rows):
    """Each of the engine's weight products (GPT-2's fused q/k/v, its projections, the tied head; quantized ones
    too): gemm_cost's bytes are the weight tensor (its scales with it, biases left out) the layer stores, plus the
    input rows it reads and the output rows it writes, in the model's float dtype; its FLOPs 2 per weight per row."""
    model = GPT2(CONFIG).init_weights(0)
    if fmt in ("int8", "int4"):
        model, dtype = quantize_model(model, fmt), torch.float32
    else:
        dtype = getattr(torch, fmt)
        model = model.to(dtype)
    name, C = str(dtype).removeprefix("torch."), CONFIG.n_embd
    run = [
        (layer, n_in, lambda x, layer=layer: layer(x, model.parts.linear))
        for block in model.h
        for layer, n_in in (
            (block.attn.c_attn, C),
            (block.attn.c_proj, C),
            (block.mlp.c_fc, C),
            (block.mlp.c_proj, 4 * C),
        )
    ]
    run.append((model.wte, C, model.wte.logits))
    g = torch.Generator().manual_seed(0)
    for layer, n_in, product in run:
        stored = [layer.qweight, layer.scales] if hasattr(layer, "qweight") else [layer.weight]
        x = torch.randn(rows, n_in, generator=g).to(dtype)
        with torch.no_grad():
            y = product(x)
        cost = gemm_cost(rows, y.shape[-1], n_in, fmt, name)
        assert cost.bytes == sum(t.nbytes for t in stored) + x.nbytes + y.nbytes, (layer, fmt)
        assert cost.flops == 2 * rows * y.shape[-1] * n_in


def test_gpt2_matrices_are_the_engines_weights_less_biases_norms_and_positions():
    model = GPT2(GPT2Config())
    small = sum(p.numel() for n, p in model.named_parameters() if n.endswith("bias") or ".ln" in n or "ln_f" in n)
    rest = sum(p.numel() for p in model.parameters()) - small - model.wpe.weight.numel()
    assert ModelShape.of(GPT2Config()).resident_params() == rest == 123_532_032
    no_rows = step_kernels(SHAPES["GPT-2 124M"], 0, 1, 0, "float32", "float32")  # the weights' bytes alone
    assert sum(k.bytes for k in no_rows) == 4 * rest


@pytest.mark.parametrize("name", ["Llama-2-7B", "Llama-3-8B", "Llama-3.2-1B"])
def test_llama_shapes_hold_transformers_parameters_less_norms(name):
    """transformers' LlamaForCausalLM with the published configuration (built on the meta device: no memory)."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    s = SHAPES[name]
    config = HFLlamaConfig(
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, context, new", STEPS)
def test_attention_bytes_are_the_engines_cache_and_query_tensors(dtype, batch, context, new):
    """The engine's GQA Llama: attention_cost's bytes are the KVCache's keys and values of the positions attended
    (its n_kv_head heads, read once), the new positions' keys and values written into it, and each layer's
    queries read and output written (its n_head heads), as the tensors the step holds."""
    seen = []

    def recording(q, k, v, mask=None):
        out = attention_with_softmax(q, k, v, mask)
        seen.append(q.nbytes + out.nbytes)
        return out

    model = Llama(LLAMA, Parts().replace(attention=recording)).init_weights(0).to(dtype).eval()
    cache = model.new_cache(batch, context + new + 5)  # room beyond: only the positions attended count
    with torch.no_grad():
        if context:
            model(torch.zeros(batch, context, dtype=torch.long), cache=cache)
        seen.clear()
        model(torch.zeros(batch, new, dtype=torch.long), cache=cache)
    read = sum(t[:, :, : context + new].nbytes for t in cache.k + cache.v)
    written = sum(t[:, :, context : context + new].nbytes for t in cache.k + cache.v)
    assert len(seen) == LLAMA.n_layer
    name = str(dtype).removeprefix("torch.")
    assert attention_cost(ModelShape.of(LLAMA), batch, new, context, name).bytes == read + written + sum(seen)


@pytest.mark.parametrize("n_rep", [1, 4, 8])
@pytest.mark.parametrize("dtype, value", [("bfloat16", 2), ("float32", 4)])
def test_decode_attention_intensity_tends_to_twice_the_group_over_bytes_per_value(n_rep, dtype, value):
    """At decode a query head does 4·D FLOPs per cached position; its group shares the 2·D values read: the
    intensity rises with the context towards 2·n_rep / bytes per value, whatever the batch, and never reaches it."""
    shape = ModelShape(4, 1024, 8 * n_rep, 8, 128, 4096, 1000)
    limit = 2 * n_rep / value
    intensities = []
    for context in (10, 100, 1000, 10**4, 10**5, 10**6):
        cost, one = attention_cost(shape, 16, 1, context, dtype), attention_cost(shape, 1, 1, context, dtype)
        intensities.append(cost.flops / cost.bytes)
        assert cost.flops / cost.bytes == pytest.approx(one.flops / one.bytes, rel=1e-12)  # whatever the batch
    assert intensities == sorted(intensities) and intensities[-1] < limit
    assert intensities[-1] == pytest.approx(limit, rel=1e-5)


def test_step_time_is_the_sum_of_the_kernels_and_not_one_point():
    """A decode step of Llama-3-8B at batch 1024 on an H100: its weight products compute-bound, attention
    memory-bound. step_time sums each kernel's own roofline time; one point for the whole step (summed FLOPs over
    summed bytes) would call it memory-bound and 16 % faster."""
    machine = gpu_roof("H100 SXM")
    kernels = step_kernels(SHAPES["Llama-3-8B"], 1024, 1, 1024, "bfloat16", "bfloat16")
    t = step_time(kernels, *machine)
    assert isinstance(t, StepTime) and t.kernels == [roofline_time(k.flops, k.bytes, *machine) for k in kernels]
    assert t.seconds == sum(k.seconds for k in t.kernels)
    assert {k.bound for k in t.kernels} == {"memory", "compute"}
    one_point = roofline_time(sum(k.flops for k in kernels), sum(k.bytes for k in kernels), *machine)
    assert one_point.bound == "memory" and t.seconds > 1.15 * one_point.seconds
    # on a step whose kernels are all of one kind the two agree
    decode = step_kernels(SHAPES["Llama-3-8B"], 1, 1, 1024, "bfloat16", "bfloat16")
    single = roofline_time(sum(k.flops for k in decode), sum(k.bytes for k in decode), *machine)
    assert step_time(decode, *machine).seconds == pytest.approx(single.seconds, rel=1e-12)


def test_roofline_time_picks_the_larger_time_and_memory_on_a_tie():
    assert roofline_time(10, 10, peak_flops=1, bandwidth=1) == (10, "memory", 1.0, 1.0)
    assert roofline_time(30, 10, peak_flops=1, bandwidth=2).bound == "compute"
    assert roofline_time(30, 10, peak_flops=1, bandwidth=2).seconds == 30
    assert roofline_time(0, 10, peak_flops=1, bandwidth=2).intensity == 0.0


def brute_critical_batch(shape, weights, dtype, peak, bandwidth, up_to):
    """The first batch at which every weight product of a decode step is compute-bound, trying each batch."""
    for batch in range(1, up_to + 1):
        kernels = step_kernels(shape, batch, 1, 0, weights, dtype)
        if all(roofline_time(k.flops, k.bytes, peak, bandwidth).bound == "compute" for k in kernels if k.name in GEMMS):
            return batch
    return None


@pytest.mark.parametrize("shape", [ModelShape.of(CONFIG), ModelShape.of(LLAMA)], ids=["gpt2", "llama-gqa"])
@pytest.mark.parametrize(
    "weights, dtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("int8", "float32"), ("int4", "bfloat16")]
)
@pytest.mark.parametrize("ridge", [0.6, 2.0, 5.0, 9.0, 40.0])
def test_critical_batch_is_the_first_batch_where_every_product_is_compute_bound(shape, weights, dtype, ridge):
    """A slow machine (its ridge a few FLOPs per byte) puts the critical batch of a tiny model at a few rows, where
    trying every batch finds it; a ridge above the thinnest product's highest intensity (2·out·in / ((in + out) ·
    bytes per value), as the batch grows) leaves some product memory-bound at every batch: None."""
    peak, bandwidth = ridge * 1e9, 1e9
    found = critical_batch(shape, weights, dtype, peak, bandwidth, max_batch=4096)
    assert found == brute_critical_batch(shape, weights, dtype, peak, bandwidth, 4096)
    if found is not None and found > 1:
        assert critical_batch(shape, weights, dtype, peak, bandwidth, max_batch=found - 1) is None
    if ridge == 40.0:
        assert found is None


def test_llama_3_8b_turns_compute_bound_at_462_on_an_h100():
    """GQA's k and v (1024 × 4096) are the thinnest products: the last to turn compute-bound."""
    machine = gpu_roof("H100 SXM")
    assert critical_batch(SHAPES["Llama-3-8B"], "bfloat16", "bfloat16", *machine) == 462
    assert brute_critical_batch(SHAPES["Llama-3-8B"], "bfloat16", "bfloat16", *machine, 500) == 462
    kernels = {k.name: k for k in step_kernels(SHAPES["Llama-3-8B"], 461, 1, 0, "bfloat16", "bfloat16")}
    late = [n for n in GEMMS if roofline_time(kernels[n].flops, kernels[n].bytes, *machine).bound == "memory"]
    assert late == ["k", "v"]


def test_predict_llama_3_8b_at_batch_1024_on_an_h100():
    """predict's doctest figure, taken apart: 58.5 ms, of which the eight weight products compute-bound (their FLOPs
    over the peak, 15.5 ms), attention memory-bound (the caches over the bandwidth, 41.3 ms) and the elementwise
    kernels 1.6 ms; 56.8 ms without them."""
    machine = (989e12, 3.35e12)
    p = predict(SHAPES["Llama-3-8B"], machine, batch=1024, context=1024, weights="bfloat16", dtype="bfloat16")
    assert round(p.seconds * 1e3, 1) == 58.5 and p.tokens_per_s == 1024 / p.seconds
    assert p.compute_bound() == list(GEMMS)
    bounds = {k.name: t.bound for k, t in zip(p.kernels, p.times)}
    assert bounds["attention"] == bounds["elementwise"] == "memory"
    kernels = {k.name: k for k in p.kernels}
    products = sum(kernels[n].flops for n in GEMMS) / machine[0]
    assert p.time_of(*GEMMS) == pytest.approx(products, rel=1e-12) and round(products * 1e3, 1) == 15.5
    assert p.time_of("attention") == kernels["attention"].bytes / machine[1]
    assert round(p.time_of("attention") * 1e3, 1) == 41.3 and round(p.time_of("elementwise") * 1e3, 1) == 1.6
    assert round((p.seconds - p.time_of("elementwise")) * 1e3, 1) == 56.8
    assert p.seconds == pytest.approx(p.time_of(*GEMMS, "attention", "elementwise"), rel=1e-12)


def test_utilization_and_predict():
    assert utilization(2e9, 1e9, 0.01, 1e12, 2e11) == (0.5, 0.2)
    p = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), measured_seconds=0.01)
    assert p.compute_bound() == [] and math.isclose(p.tokens_per_s, 1 / p.seconds)
    assert math.isclose(p.mbu, p.bytes / 0.01 / 3.35e12) and math.isclose(p.mfu, p.flops / 0.01 / 989e12)
    # predict runs its table's functions: attention that costs nothing takes the cache's time away
    free = Roofline().replace(attention_cost=lambda *a: (0.0, 0.0))
    long = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), context=8192)
    assert predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), context=8192, table=free).seconds == pytest.approx(
        long.seconds - long.time_of("attention"), rel=1e-12
    )
    # the head on the last position only: a prefill's head multiplies one row per sequence
    full = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), batch=2, new_tokens=100)
    last = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), batch=2, new_tokens=100, last_only=True)
    assert last.kernels[:-1] == full.kernels[:-1] and last.kernels[-1][1:] == gemm_cost(2, 128256, 4096)


def test_the_guards_return_what_the_engine_returns():
    """Every roofline slot, guarded as a learner's function is, gives predict the same prediction as the engine's
    own (a learner's tuples become Cost, StepTime, RooflineTime)."""
    table = Roofline().replace(**{n: guard(n, getattr(Roofline(), n)) for n in Roofline.slot_names()})
    as_tuples = Roofline().replace(
        gemm_cost=guard("gemm_cost", lambda *a: tuple(gemm_cost(*a))),
        attention_cost=guard("attention_cost", lambda *a: list(attention_cost(*a))),
        step_time=guard("step_time", lambda *a: (step_time(*a)[0], [tuple(t) for t in step_time(*a)[1]])),
    )
    settings = dict(batch=64, context=512, weights="int8", dtype="bfloat16", measured_seconds=0.02)
    expected = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), **settings)
    for t in (table, as_tuples):
        got = predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), **settings, table=t)
        assert got == expected and all(isinstance(x, RooflineTime) for x in got.times)
    kernels = [("q", 1.0, 0.0)]  # no bytes: an infinite intensity is a valid answer
    assert guard("step_time", step_time)(kernels, 1.0, 1.0).kernels[0].intensity == math.inf


@pytest.mark.parametrize(
    "name, wrong, message",
    [
        ("gemm_cost", lambda *a: 5.0, r"expected \(flops, bytes\), two numbers >= 0"),
        ("attention_cost", lambda *a: (1.0, -2.0), r"expected \(flops, bytes\), two numbers >= 0"),
        ("step_time", lambda kernels, *a: step_time(kernels, *a)[0], r"expected \(seconds, \[\(seconds"),
        ("step_time", lambda kernels, *a: (1.0, step_time(kernels, *a)[1][:-1]), r"one for each of the 10 kernels"),
        ("step_time", lambda kernels, *a: (1.0, [(1.0, "slow", 1.0, 1.0)] * 10), r'"memory" or "compute"'),
    ],
)
def test_a_learners_wrong_output_stops_predict_with_the_slots_name(name, wrong, message):
    table = Roofline().replace(**{name: guard(name, wrong)})
    with pytest.raises(
        PartError,
        match=rf"part '{name}' .*{message}.*\n  hint: run the check for '{name}' in "
        "chapter 10",
    ):
        predict(SHAPES["Llama-3-8B"], gpu_roof("H100 SXM"), table=table)


def test_datasheets_are_dense_figures_and_cards_are_recognised():
    for card in GPUS.values():
        if card.peak_flops is not None:
            assert card.sparse_flops == pytest.approx(2 * card.peak_flops, rel=0.01)
    assert card_of("NVIDIA H200") == "H200 SXM" and card_of("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert card_of("NVIDIA A100-SXM4-40GB") is None and card_of("Tesla T4") is None
    with pytest.raises(ValueError, match="unknown card"):
        gpu_roof("H100 PCIe")
