"""LLMEngine's decode steps as graphs of fixed shapes (`serving.decode_graphs`), and what the GPU path runs: the
static paged step reads the pool through FlexAttention's block mask, the batch is padded to a bucket, and every
request still gets exactly its alone tokens. Here the graphs are traced by dynamo's eager backend (the root
conftest.py); the tests named *cuda* capture CUDA graphs and run the fused int8 / int4 kernels where a GPU is."""

from __future__ import annotations

import pytest
import torch

from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.quantize import dequantize_int4, quantize_int4, quantize_model, tinygemm_layout, unpack_int4
from llmcourse.serving import paged_cache
from llmcourse.serving.batching import Batching
from llmcourse.serving.decode_graphs import bucket_sizes
from llmcourse.serving.llm_engine import LLMEngine

from .conftest import CUDA
from .test_llm_engine import Tally, run_workloads, tiny_model

GQA = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, intermediate_size=128, vocab_size=300, n_positions=128)


def pools(num_blocks: int, block_size: int, H_kv: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, H_kv, D, generator=g), torch.randn(
        num_blocks, block_size, H_kv, D, generator=g
    )


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)], ids=["MHA", "GQA", "MQA"])
def test_flex_attention_over_the_pool_equals_the_block_loop(heads):
    """Shuffled blocks, a block shared by two tables (a cached prefix), partial and full last blocks, a request of
    one position, tables padded past their length with blocks of other requests: only the listed positions count."""
    H, H_kv = heads
    k_pool, v_pool = pools(14, 4, H_kv, 8, seed=H * 10 + H_kv)
    tables = torch.tensor([[3, 7, 1, 9, 2], [3, 7, 12, 2, 9], [5, 0, 1, 2, 3], [2, 9, 11, 4, 6], [13, 1, 3, 7, 0]])
    lengths = torch.tensor([10, 12, 1, 20, 5])
    q = torch.randn(5, H, 8, generator=torch.Generator().manual_seed(1))
    expected, _ = paged_cache.paged_attention(q, k_pool, v_pool, tables, lengths)
    mask = paged_cache.flex_mask(tables, lengths, 4, 14)
    got = paged_cache.paged_attention_flex(q, k_pool, v_pool, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # what the kernel is told to read: each row's full blocks, and its last one through the mask function
    assert mask.full_kv_num_blocks.flatten().tolist() == [2, 2, 0, 4, 1]
    assert mask.kv_indices[:, 0, 0, 0].tolist() == [1, 12, 5, 6, 1]
    dense = mask.to_dense()[:, 0, 0]  # [G, 14]: the blocks each row reads
    assert dense[0].nonzero().flatten().tolist() == [1, 3, 7] and dense[2].nonzero().flatten().tolist() == [5]


def test_the_padding_block_changes_nothing():
    """A padding row of the bucket writes to the spare block and reads only it: the real rows' output is the same
    whatever the spare block holds."""
    k_pool, v_pool = pools(6, 4, 2, 8, seed=3)
    tables, lengths = torch.tensor([[0, 1], [2, 5], [5, 5]]), torch.tensor([7, 5, 1])  # row 2: padding on block 5
    q = torch.randn(3, 4, 8)
    before = paged_cache.paged_attention_flex(q, k_pool, v_pool, paged_cache.flex_mask(tables, lengths, 4, 6))
    k_pool[5, 1:], v_pool[5, 1:] = 100.0, -100.0  # the spare block's other slots: never read
    after = paged_cache.paged_attention_flex(q, k_pool, v_pool, paged_cache.flex_mask(tables, lengths, 4, 6))
    torch.testing.assert_close(after[:2], before[:2], atol=0, rtol=0)


def test_buckets_cover_every_batch_size_up_to_the_most():
    for most in (1, 5, 32, 48, 700):
        buckets = bucket_sizes(most)
        assert buckets[-1] == most and buckets == sorted(set(buckets))
        assert all(b & (b - 1) == 0 for b in buckets[:-1])  # powers of two below the most


def test_compiled_engine_gives_every_request_its_alone_tokens():
    """The LLMEngine property (arrivals, chunked prefill, preemption, prefix caching, sampling, EOS and stop strings)
    with decode-only steps run through the graphs."""
    tally = Tally()
    run_workloads(range(3000, 3008), tiny_model, tally, compile=True)
    assert tally.workloads == 8 and tally.preempted >= 1 and tally.cached >= 1, tally


def test_compiled_engine_pads_to_buckets_and_equals_eager_with_grouped_query_attention():
    model = Llama(GQA).init_weights(seed=5)
    prompts = [[1, 2, 3], [7] * 20, list(range(40, 75)), [9, 8]]
    eager = LLMEngine(model, max_num_seqs=4, num_blocks=24, block_size=4)
    compiled = LLMEngine(model, max_num_seqs=4, num_blocks=24, block_size=4, compile=True)
    lengths = [12, 30, 5, 18]  # requests leave at different steps: batches of 4, 3, 2 and 1
    expected = [eager.generate([p], max_new_tokens=n, eos_token_id=None)[0] for p, n in zip(prompts, lengths)]
    got = [compiled.generate(prompts, max_new_tokens=n, eos_token_id=None)[i] for i, n in enumerate(lengths)]
    assert got == expected
    assert compiled.graphs.sizes_run == {1, 2, 4}  # 3 requests ran in the bucket of 4
    assert compiled.cache.k[0].shape[0] == compiled.blocks.num_blocks + 1  # the spare block


def test_compile_refuses_a_learners_batching_functions():
    batching = Batching().replace(paged_attention=paged_cache.paged_attention)
    with pytest.raises(ValueError, match=r"compile=True runs the engine's own .*\(paged_attention\)"):
        LLMEngine(tiny_model(0), batching=batching, compile=True)


def test_tinygemm_layout_gives_the_int4_product():
    """The layout handed to CUDA's tinygemm, checked through torch's CPU twin of the kernel (which takes the same
    values unpacked to int32, and the same scales and zeros): x @ W.T of the course's int4 weights."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    packed, scales = quantize_int4(w)
    high_first, scales_and_zeros = tinygemm_layout(packed, scales)
    assert high_first.shape == (64, 128) and scales_and_zeros.shape == (8, 64, 2)
    values = torch.stack([high_first >> 4, high_first & 15], dim=-1).view(64, 256).int()  # u = q + 8, in order
    assert torch.equal(values - 8, unpack_int4(packed).int())
    tiles = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2)
    x = torch.randn(3, 256, generator=g)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, tiles, 32, scales_and_zeros.float())
    expected = x @ dequantize_int4(packed, scales.bfloat16().half()).T  # scales as tinygemm holds them (bfloat16)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_fused_low_bit_products_on_cuda(fmt):
    """bfloat16 on CUDA: int8 through torch._weight_int8pack_mm where torch has it, int4 through tinygemm; the
    same numbers as the weights dequantized, within bfloat16's rounding."""
    config = LlamaConfig(n_layer=1, n_head=4, n_kv_head=2, n_embd=256, intermediate_size=512, vocab_size=512)
    model = quantize_model(Llama(config).init_weights(seed=2), fmt).to("cuda", torch.bfloat16)
    layer = model.layers[0].mlp.gate_proj
    assert fmt == "int8" or layer.tinygemm is not None
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    weight = layer.qweight.float() * layer.scales.float()[:, None] if fmt == "int8" else None
    if fmt == "int4":
        weight = dequantize_int4(layer.qweight, layer.scales)
    expected = x.float() @ weight.T
    torch.testing.assert_close(layer(x).float(), expected, atol=0.05, rtol=0.02)


@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_compiled_engine_equals_eager_on_cuda(monkeypatch):
    """CUDA graphs per bucket (inductor, reduce-overhead) against the eager engine, float32: the same greedy tokens."""
    monkeypatch.setenv("LLMCOURSE_COMPILE_BACKEND", "inductor")
    model = Llama(GQA).init_weights(seed=5).to("cuda")
    prompts = [[1, 2, 3], [7] * 20, list(range(40, 75))]
    eager = LLMEngine(model, max_num_seqs=4).generate(prompts, max_new_tokens=16, eos_token_id=None)
    compiled = LLMEngine(model, max_num_seqs=4, compile=True)
    assert compiled.generate(prompts, max_new_tokens=16, eos_token_id=None) == eager
    assert compiled.graphs.sizes_run == {4}  # three requests, one bucket


def test_the_command_line_says_it_in_flags():
    from llmcourse.__main__ import in_flag_terms

    message = "compile=True runs the engine's own paged attention and batching functions; ...: leave out compile=True"
    assert in_flag_terms(message) == (
        "--compile runs the engine's own paged attention and batching functions; ...: leave out --compile"
    )


def test_serve_compile_answers_as_the_eager_engine():
    """`serve --compile` (traced by dynamo's eager backend here, as the whole suite compiles): greedy completions
    of several concurrent requests equal `generate` alone."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from llmcourse import load_model
    from llmcourse.engine.generate import generate_text
    from llmcourse.engine.hf_tokenizer import load_tokenizer

    from .test_server import free_port, ping, wait_until

    port = free_port()
    command = [
        sys.executable,
        "-m",
        "llmcourse",
        "serve",
        "--model",
        "llama-shakespeare",
        "--compile",
        "--port",
        str(port),
    ]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "LLMCOURSE_COMPILE_BACKEND": "eager"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: ping(url), 60), process.stderr.read() if process.poll() is not None else "no start"
        prompts = ["ROMEO:", "JULIET:", "Good morrow, cousin.", "To be, or not to be"]

        def complete(prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            return httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, prompts))
    finally:
        process.terminate()
        process.wait(timeout=30)
    model, tok = load_model("llama-shakespeare"), load_tokenizer("llama-shakespeare")
    assert got == [generate_text(model, tok, tok.encode(p), max_new_tokens=12) for p in prompts]
