"""The engine's float32 CPU kernels (`llmcourse.engine.cpu_kernels`: `linear`, `decode_attention`) and the thread
count it computes with (`llmcourse.engine.threads`).

- `linear` gives torch.addmm's product (float64 reference, relative error ~1e-6) for weights stored as the engine
  stores them (the transpose of an [N, K] matrix), with and without bias, for column counts that are not
  multiples of 8 and for strided rows; a row's numbers are the same bit for bit alone, in any batch up to
  FLOAT_ROWS rows and with any number of threads (what makes batched decoding equal decoding alone); where it does
  not apply (the checkpoint's [K, N] layout, more rows, gradients, float64, torch.compile) it is torch's product
  exactly.
- The kernels' threads (kernels/pool.c): every kernel gives the same numbers on 1, 2 and 3 threads, and when every
  helper thread is held (as if the system had parked them all) the caller computes the whole job itself.
- `decode_attention` gives torch's fused attention's output (1e-6) with padding masks, grouped-query heads and
  cache views, the same numbers for a sequence alone or in a batch, and torch's kernel where it does not apply.
- The engine decodes the same greedy tokens with the kernels as with torch's products, and its logits agree.
- Threads: OMP_NUM_THREADS or a torch.set_num_threads call is kept; otherwise the engine takes every core.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llmcourse.engine import cpu_kernels, threads
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.model import GPT2

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="the C kernels cannot be built here")


def reference(rows, weight, bias):
    y = rows.double() @ weight.double()
    return y if bias is None else y + bias.double()


def relative_error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("K, N", [(768, 2304), (64, 50257), (40, 13), (3072, 768), (8, 1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_is_addmm(layout, K, N, with_bias):
    g = torch.Generator().manual_seed(K + N)
    weight = torch.randn(K, N, generator=g) if layout == "kn" else torch.randn(N, K, generator=g).T
    bias = torch.randn(N, generator=g) if with_bias else None
    rows = torch.randn(cpu_kernels.FLOAT_ROWS, K, generator=g)
    batch = cpu_kernels.linear(rows, weight, bias)
    assert relative_error(batch, reference(rows, weight, bias)) < 1e-5
    if weight.stride(0) != 1 or K % 8:  # torch's product (a [K, 1] weight is both layouts at once)
        assert torch.equal(batch, torch.mm(rows, weight) if bias is None else torch.addmm(bias, rows, weight))
        return
    for m in (1, 2, 3, 7, 16):  # a row's numbers do not depend on the batch it is in
        assert torch.equal(cpu_kernels.linear(rows[:m], weight, bias), batch[:m])


@contextlib.contextmanager
def threads_held(count: int, held: bool):
    """torch's (and so the kernels') thread count set to `count`; `held`: the pool's helpers take no work."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    cpu_kernels.library().pool_hold_helpers(int(held))
    try:
        yield
    finally:
        cpu_kernels.library().pool_hold_helpers(0)
        torch.set_num_threads(before)


def test_every_kernel_gives_the_same_numbers_on_any_threads_and_with_its_helpers_parked():
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(1000, 256, generator=g).T, torch.randn(1000, generator=g)
    wide = torch.randn(5, 300, generator=g)
    rows = wide[:, 20:276]  # rows 300 floats apart
    q8, s8 = torch.randint(-127, 128, (1000, 256), dtype=torch.int8, generator=g), torch.rand(1000, generator=g)
    packed = torch.randint(0, 256, (1000, 128), dtype=torch.uint8, generator=g)
    scales = torch.rand(1000, 8, generator=g).half()
    q = torch.randn(3, 12, 1, 64, generator=g)
    k, v = torch.randn(3, 4, 300, 64, generator=g), torch.randn(3, 4, 300, 64, generator=g)

    def run():
        return [
            cpu_kernels.linear(rows, weight, bias),
            cpu_kernels.int8_linear(rows.contiguous(), q8, s8, bias),
            cpu_kernels.int4_linear(rows.contiguous(), packed, scales, bias),
            cpu_kernels.int4_dequantized(packed, scales),
            cpu_kernels.decode_attention(q, k, v),
        ]

    with threads_held(1, held=False):
        one = run()
    for count, held in [(2, False), (3, False), (2, True)]:
        with threads_held(count, held):
            for name, a, b in zip(["linear", "int8", "int4", "int4 dequantized", "attention"], one, run()):
                assert torch.equal(a, b), f"{name} on {count} threads{' (helpers held)' * held}"
    assert torch.equal(one[0], cpu_kernels.linear(rows.contiguous(), weight, bias))
    assert relative_error(one[0], reference(rows, weight, bias)) < 1e-5


def test_a_prefills_products_go_in_column_chunks_on_the_engines_threads():
    """More rows than the C kernels take: torch's product, cut by output columns between the engine's threads; the
    same numbers as the whole product (the same library's sums: 1e-6), and a chunk's error reaches the caller."""
    g = torch.Generator().manual_seed(5)
    rows, weight, bias = torch.randn(100, 256, generator=g), torch.randn(1000, 256, generator=g).T, torch.randn(1000)
    calls = []
    with threads_held(2, held=False), cpu_kernels.computing():
        assert torch.get_num_threads() == 1 and cpu_kernels.kernel_threads() == 2
        got = cpu_kernels.linear(rows, weight, bias)
        cpu_kernels.in_column_chunks(lambda c: calls.append(c) or torch.zeros(1, c.stop - c.start), 1000)
        with pytest.raises(ZeroDivisionError):
            cpu_kernels.in_column_chunks(lambda c: torch.zeros(1, c.stop - c.start) if c.start != 128 else 1 / 0, 1000)
    assert len(calls) > 2 and sorted(c.start for c in calls) == [c.start for c in calls]
    assert relative_error(got, reference(rows, weight, bias)) < 1e-5
    assert (got - torch.addmm(bias, rows, weight)).abs().max() < 1e-4


def test_linear_falls_back_to_torch_where_the_kernel_does_not_apply():
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(48, 64, generator=g).T, torch.randn(48, generator=g)
    many = torch.randn(cpu_kernels.FLOAT_ROWS + 1, 64, generator=g)
    assert torch.equal(cpu_kernels.linear(many, weight, bias), torch.addmm(bias, many, weight))
    rows = many[:2].double()
    assert torch.equal(
        cpu_kernels.linear(rows, weight.double(), bias.double()), torch.addmm(bias.double(), rows, weight.double())
    )
    trained = weight.clone().requires_grad_()
    y = cpu_kernels.linear(many[:2], trained, bias)
    y.sum().backward()  # torch's product: gradients flow
    assert torch.equal(trained.grad, many[:2].sum(0)[:, None].expand(64, 48))


@pytest.mark.parametrize("mask", [False, True])
def test_decode_attention_is_torchs(mask):
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 4, 6, 37, 64
    cache_k, cache_v = torch.randn(B, H, 50, D, generator=g), torch.randn(B, H, 50, D, generator=g)
    k, v = cache_k[:, :, :T], cache_v[:, :, :T]  # views of a longer cache, as decoding passes them
    q = torch.randn(B, 1, 3 * H * D, generator=g)[..., : H * D].view(B, 1, H, D).transpose(1, 2)
    allowed = torch.rand(B, 1, 1, T, generator=g) > 0.3 if mask else None
    if mask:
        allowed[..., -1] = True
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed)
    got = cpu_kernels.decode_attention(q, k, v, allowed)
    assert got.shape == (B, H, 1, D) and (got.double() - want).abs().max() < 1e-5
    alone = cpu_kernels.decode_attention(q[2:3], k[2:3], v[2:3], None if allowed is None else allowed[2:3])
    assert torch.equal(alone, got[2:3])


def test_decode_attention_reads_grouped_query_heads_and_falls_back():
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(2, 8, 1, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
        torch.randn(2, 2, 9, 16, generator=g),
    )
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
    assert (cpu_kernels.decode_attention(q, k, v) - want).abs().max() < 1e-5
    q2 = torch.randn(2, 2, 1, 12, generator=g)  # D = 12: not a multiple of 8, torch's kernel
    k2, v2 = torch.randn(2, 2, 5, 12, generator=g), torch.randn(2, 2, 5, 12, generator=g)
    assert torch.equal(cpu_kernels.decode_attention(q2, k2, v2), F.scaled_dot_product_attention(q2, k2, v2))


def test_the_engine_decodes_the_same_with_and_without_the_kernels(monkeypatch):
    """Greedy tokens of a random 4-layer GPT-2, with the kernels and with torch's products (the kernels turned
    off), equal; the logits of each step within 1e-4."""
    from llmcourse.engine.generate import decode_steps
    from llmcourse.engine.sampling import SamplingParams

    model = GPT2(GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=128, vocab_size=500)).init_weights(3).eval()
    prompts = [[5, 9, 2, 77, 3], [8, 1]]

    def run():
        with torch.inference_mode():
            logits = model(torch.tensor([[5, 9, 2, 77, 3]]))
            steps = decode_steps(model, prompts, SamplingParams(), max_new_tokens=12, eos_token_id=None, generator=None)
            return logits, torch.stack(list(steps), dim=1)

    fast_logits, fast = run()
    monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    slow_logits, slow = run()
    assert torch.equal(fast, slow) and (fast_logits - slow_logits).abs().max() < 1e-4


def test_threads_are_the_engines_choice_unless_someone_chose(monkeypatch):
    assert threads.engine_threads(cores=1) == 1 and threads.engine_threads(cores=2) == 2
    assert threads.engine_threads(cores=64) == 64
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.someone_chose()


@pytest.mark.parametrize(
    "program, expected",
    [
        # nobody chose: every core
        ("from llmcourse.engine import threads; print(threads.choose() == threads.engine_threads())", "True"),
        # torch.set_num_threads before: kept
        ("import torch; torch.set_num_threads(3); from llmcourse.engine import threads; print(threads.choose())", "3"),
        # ... and after the engine chose: kept
        (
            "import torch; from llmcourse.engine import threads; threads.choose(); torch.set_num_threads(3); "
            "print(threads.choose())",
            "3",
        ),
    ],
)
def test_choose_in_a_fresh_process(program, expected):
    env = {k: v for k, v in __import__("os").environ.items() if k not in threads.ENVIRONMENT}
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    if expected == "3" and threads.TORCH_START == 3:
        pytest.skip("on a 3-core machine 3 threads is torch's own count")
    assert out.stdout.strip() == expected


def test_an_environment_setting_is_kept():
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "2"}
    program = "from llmcourse.engine import threads; import torch; print(threads.choose(), torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2", "2"]


def test_shapes_that_do_not_fit_raise_instead_of_reading_past_the_memory():
    """A weight in the other layout once crashed the process (a segmentation fault: the C kernel read K rows of a
    matrix that had fewer); now torch's error, or the kernel's own, says what does not fit."""
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        cpu_kernels.linear(torch.randn(1, 768), torch.randn(192, 768), torch.randn(768))  # [N, K] given for [K, N]
    with pytest.raises(RuntimeError):
        cpu_kernels.linear(torch.randn(1, 192), torch.randn(192, 576), torch.randn(192))  # a bias of the wrong size
    with pytest.raises(ValueError, match="do not fit the weight"):
        cpu_kernels.int8_linear(torch.randn(1, 64), torch.zeros(16, 32, dtype=torch.int8), torch.ones(16), None)
    with pytest.raises(ValueError, match="do not fit the weight"):
        cpu_kernels.int4_linear(torch.randn(1, 64), torch.zeros(16, 16, dtype=torch.uint8),
                                torch.ones(16, 1, dtype=torch.float16), None)  # fmt: skip
    with pytest.raises(ValueError, match="differ in batch, heads or positions"):
        cpu_kernels.decode_attention(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(RuntimeError):
        cpu_kernels.decode_attention(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
