"""The static-shape decode step (torch.compile, CUDA graphs) and a decode loop free of host syncs.

The static step writes each token's keys/values at a slot given as a tensor and attends to the
whole preallocated cache through the mask, so every step has the same shapes. It must compute what
the growing-cache step computes: same logits within float tolerance, same tokens.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmcourse.engine.generate import CompileError, decode_step, decode_steps, generate
from llmcourse.engine.sampling import SamplingParams

from .conftest import CUDA, DEVICES, SMALL, lively_model

generation = importlib.import_module("llmcourse.engine.generate")  # the module (the package exports its function)
PROMPTS = [[464, 2068, 7586, 21831, 18045, 625], [15496, 11, 995], [40, 1101, 257, 3303, 2746, 13, 632, 318]]


@pytest.fixture(scope="module")
def model():
    return lively_model(SMALL, seed=3)


def test_slot_step_equals_growing_cache_step(model):
    ids = torch.randint(0, SMALL.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    ones = torch.ones(2, 40, dtype=torch.long)
    with torch.inference_mode():
        growing, static = model.new_cache(2, 40), model.new_cache(2, 40)
        model(ids[:, :25], cache=growing)
        model(ids[:, :25], cache=static)
        static.length = 25
        for t in range(25, 40):
            expected = model(ids[:, t : t + 1], cache=growing)
            got = model(ids[:, t : t + 1], attention_mask=ones, cache=static, slot=torch.tensor([t]))
            diff = (got - expected).abs().max().item()
            assert diff < 1e-3, f"step at position {t}: logits differ by {diff}"  # logits here are ~1e3
    for layer in range(SMALL.n_layer):
        assert torch.allclose(static.k[layer], growing.k[layer], atol=1e-5)
        assert torch.allclose(static.v[layer], growing.v[layer], atol=1e-5)


def test_slot_needs_a_mask_over_the_whole_cache(model):
    cache = model.new_cache(1, 8)
    with torch.inference_mode(), pytest.raises(ValueError, match="attention_mask over all cache.max_len"):
        model(
            torch.tensor([[1]]), attention_mask=torch.ones(1, 4, dtype=torch.long), cache=cache, slot=torch.tensor([3])
        )


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(repetition_penalty=1.3), dict(temperature=1.1, top_k=50, top_p=0.95, seed=4)],
    ids=["greedy", "repetition-penalty", "sampling"],
)
def test_static_decoding_gives_the_same_tokens(model, monkeypatch, settings):
    """The compile=True loop (static shapes, slot, full mask) run eagerly: padded batch, EOS, sampling."""
    monkeypatch.setattr(generation, "compiled_decode_step", lambda model: decode_step)
    free = generate(model, PROMPTS, max_new_tokens=24, eos_token_id=None, **settings)
    assert generate(model, PROMPTS, max_new_tokens=24, eos_token_id=None, compile=True, **settings) == free
    eos = free[1][6]
    expected = generate(model, PROMPTS, max_new_tokens=24, eos_token_id=eos, **settings)
    assert generate(model, PROMPTS, max_new_tokens=24, eos_token_id=eos, compile=True, **settings) == expected
    assert expected[1][-1] == eos and len(expected[1]) <= 7


@pytest.fixture
def inductor(monkeypatch):
    """torch.compile with its default backend, inductor (the root conftest.py makes the rest of the suite trace
    with dynamo's eager backend): code generated, and on the CPU the weights frozen into the graph."""
    monkeypatch.setenv("LLMCOURSE_COMPILE_BACKEND", "inductor")
    monkeypatch.setattr(generation, "_compiled", {})
    monkeypatch.setattr(generation, "_frozen", {})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.usefixtures("inductor")
def test_compiled_decoding_equals_eager(model, device):
    """torch.compile for real (CPU: inductor; CUDA: also CUDA graphs): a batch with padding, greedy."""
    model = model.to(device)
    try:
        eager = generate(model, PROMPTS[:2], max_new_tokens=12, eos_token_id=None)
        compiled = generate(model, PROMPTS[:2], max_new_tokens=12, eos_token_id=None, compile=True)
        again = generate(model, PROMPTS[:2], max_new_tokens=12, eos_token_id=None, compile=True)  # cached graph
    finally:
        model.to("cpu")
    assert compiled == eager
    assert again == eager


@pytest.mark.usefixtures("inductor")
def test_compiled_decoding_follows_changed_weights():
    """On the CPU the weights are frozen into the compiled graph: changing them must not leave it stale."""
    model = lively_model(SMALL, seed=4)
    before = generate(model, PROMPTS[0], max_new_tokens=10, eos_token_id=None, compile=True)
    with torch.no_grad():
        model.h[0].mlp.c_fc.weight.mul_(-3)
        model.h[1].attn.c_attn.weight.mul_(-2)
    eager = generate(model, PROMPTS[0], max_new_tokens=10, eos_token_id=None)
    assert eager != before  # the change matters
    assert generate(model, PROMPTS[0], max_new_tokens=10, eos_token_id=None, compile=True) == eager


class SyncCounter(TorchDispatchMode):
    """Counts reads of a tensor's value into Python (`bool(t)`, `t.item()`): on a GPU each one waits
    for all queued work. (Copies to the host are caught by the CUDA test below.)"""

    SCALAR_READS = {
        torch.ops.aten.is_nonzero.default,
        torch.ops.aten.item.default,
        torch.ops.aten._local_scalar_dense.default,
    }

    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SCALAR_READS:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def count_loop_syncs(model, eos_token_id, steps=20) -> int:
    loop = decode_steps(
        model,
        PROMPTS,
        SamplingParams(repetition_penalty=1.2),
        max_new_tokens=steps,
        eos_token_id=eos_token_id,
        generator=None,
    )
    next(loop)  # the prefill, which copies the prompts to the device
    with SyncCounter() as counter:
        for _ in loop:
            pass
    return counter.syncs


def test_the_decode_loop_reads_nothing_back_but_the_eos_check(model, monkeypatch):
    assert count_loop_syncs(model, eos_token_id=None) == 0
    assert count_loop_syncs(model, eos_token_id=50256) == 19  # on CPU a check costs nothing: every step
    monkeypatch.setitem(generation.EOS_CHECK_EVERY, "cpu", 8)  # as on a GPU
    assert count_loop_syncs(model, eos_token_id=50256) == 2  # after steps 8 and 16


def test_rows_past_eos_are_cut_even_when_the_loop_checks_late(model, monkeypatch):
    free = generate(model, PROMPTS, max_new_tokens=20, eos_token_id=None)
    eos = free[0][2]
    expected = generate(model, PROMPTS, max_new_tokens=20, eos_token_id=eos)
    monkeypatch.setitem(generation.EOS_CHECK_EVERY, "cpu", 8)
    assert generate(model, PROMPTS, max_new_tokens=20, eos_token_id=eos) == expected


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.usefixtures("inductor")  # CUDA graphs (mode="reduce-overhead") come with inductor
def test_cuda_decode_loop_never_waits_for_the_gpu(model, compile):
    model = model.to("cuda")
    try:
        loop = decode_steps(
            model,
            PROMPTS,
            SamplingParams(temperature=0.9, repetition_penalty=1.2),
            max_new_tokens=24,
            eos_token_id=None,
            generator=torch.Generator("cuda").manual_seed(0),
            compile=compile,
        )
        next(loop), next(loop)  # the prefill's token, then the first decode step's (compiling it: compile syncs)
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = list(loop)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        model.to("cpu")
    assert len(tokens) == 22


def test_a_failing_compiler_is_a_clear_error(model, monkeypatch):
    def broken_backend(graph, example_inputs):
        raise RuntimeError("no C++ compiler found")

    compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **settings: compile(fn, backend=broken_backend, fullgraph=True))
    monkeypatch.setattr(generation, "_compiled", {})
    with pytest.raises(CompileError, match="could not compile the decode step.*without compile=True"):
        generate(model, PROMPTS[0], max_new_tokens=4, compile=True)


def test_beam_search_is_not_compiled(model):
    with pytest.raises(ValueError, match="beam search runs uncompiled"):
        generate(model, PROMPTS[0], max_new_tokens=4, num_beams=2, compile=True)
