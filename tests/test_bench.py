"""`python -m llmcourse bench` runs end to end on a tiny configuration (no timing assertions)."""

import json
import subprocess
import sys

from llmcourse.bench import decode_step_cost, roofline
from llmcourse.config import GPT2Config


def test_bench_runs_end_to_end_on_a_tiny_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "llmcourse", "bench", "--model", "tiny", "--prompt-len", "16", "--new-tokens", "8",
         "--prefill-lens", "16,32", "--contexts", "16,32", "--batch-sizes", "1,2", "--repeats", "1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "decode, batch 1" in out.stdout and "ratio" in out.stdout and "roofline" in out.stdout
    r = json.loads((tmp_path / "bench.json").read_text())
    assert set(r["decode"]) == {"engine", "engine_compiled", "transformers"}
    assert "with torch.compile" in out.stdout
    if r["device"] == "cpu":
        assert "CUDA rows" in out.stdout and "skipped" in out.stdout and r["cuda_skipped"]
    assert set(r["prefill"]) == {"16", "32"} and set(r["kv_cache"]) == {"16", "32"} and set(r["batching"]) == {"1", "2"}
    numbers = [*r["decode"].values(), *(v for p in r["prefill"].values() for v in p.values()),
               r["roofline"]["bandwidth_GBps"], r["roofline"]["matmul_GFLOPs"], r["roofline"]["bound_tokens_per_s"],
               *(v["speedup"] for v in r["kv_cache"].values()),
               *(v[k] for v in r["batching"].values()
                 for k in ("engine", "engine_compiled", "bound_tokens_per_s", "engine_fraction", "engine_compiled_fraction"))]
    assert all(isinstance(x, float) and 0 < x < 1e12 for x in numbers)
    assert {"decode_vs_transformers", "decode_compiled_vs_transformers", "prefill_16_vs_transformers",
            "decode_roofline_fraction", "decode_compiled_roofline_fraction", "kv_cache_speedup_32",
            "batch_2_vs_batch_1", "batch_2_compiled_vs_batch_1"} <= set(r["ratios"])
    # the bound of a batch counts the weights once and each row's cache and arithmetic
    assert r["batching"]["2"]["bound_tokens_per_s"] > r["batching"]["1"]["bound_tokens_per_s"]
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_decode_step_cost_of_gpt2_small():
    """124M parameters (of which 38.6M the tied head) read once per token, in float32."""
    bytes_read, flops = decode_step_cost(GPT2Config(), context=0, bytes_per_value=4)
    params = 124_439_808 - 1024 * 768  # GPT-2 small without its position table, of which decode reads one row
    assert bytes_read / 4 == params + 768
    assert abs(flops - 2 * params) / flops < 0.01
    more_bytes, more_flops = decode_step_cost(GPT2Config(), context=1000, bytes_per_value=4)
    assert more_bytes - bytes_read == 4 * 2 * 12 * 1000 * 768  # the KV cache: K and V, 12 layers, 1000 positions
    batch_bytes, batch_flops = decode_step_cost(GPT2Config(), context=1000, bytes_per_value=4, batch=16)
    assert batch_bytes - more_bytes == 15 * 4 * (2 * 12 * 1000 * 768 + 768)  # weights once, a cache per row
    assert batch_flops == 16 * more_flops


def test_roofline_picks_the_binding_limit():
    # 10 GB/s and 100 GFLOP/s; a step reading 1 GB and doing 1 GFLOP is memory-bound at 10 steps/s
    assert roofline(10e9, 100e9, 1e9, 1e9) == (10.0, "memory")
    assert roofline(10e9, 100e9, 1e9, 50e9, batch=8) == (16.0, "compute")  # 2 steps/s x 8 rows


def test_bad_bench_option_is_one_line():
    out = subprocess.run([sys.executable, "-m", "llmcourse", "bench", "--batch-sizes", "1,x"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "comma-separated integers" in out.stderr
