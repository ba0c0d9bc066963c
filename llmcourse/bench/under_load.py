"""The engine's threads on an idle machine and beside a busy process: `python -m llmcourse.bench.under_load`.

The engine computes with every core by default (`llmcourse.engine.threads`). What that is worth, and what it costs
when something else runs: greedy decoding of random GPT-2 124M weights (a 128-token prompt and 64 new tokens, the
whole call timed) in float32 and int8, at batch 1 and 16, each way in a fresh process:

- **default**: the engine's own choice, on the idle machine;
- **1 thread**: `OMP_NUM_THREADS=1`, on the idle machine;
- **default, busy**: the engine's choice with one other single-threaded process computing beside it (a Python
  loop, started before the run and stopped after it).

Medians of `--repeats` interleaved rounds (the order reversed every other round). The targets (issue 47): beside
the busy process the default keeps at least 60 % of its idle speed and at least 90 % of one thread's idle speed.

    >>> verdicts({"default": 40.0, "1 thread": 30.0, "default, busy": 28.0})
    {'busy / idle': (0.7, 0.6, True), 'busy / 1 thread idle': (0.9333333333333333, 0.9, True)}
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from llmcourse.bench.common import CONFIGS
from llmcourse.engine.generate import decode_steps
from llmcourse.engine.model import GPT2
from llmcourse.engine.quantize import quantize_model
from llmcourse.engine.sampling import SamplingParams

WAYS = ("default", "1 thread", "default, busy")
TARGETS = {"busy / idle": ("default, busy", "default", 0.6), "busy / 1 thread idle": ("default, busy", "1 thread", 0.9)}
BUSY = [sys.executable, "-c", "while True: pass"]


def child(model: str, fmt: str, batch: int, prompt_len: int, new_tokens: int) -> float:
    """In this process: tokens/s of one greedy call (after a short warm-up)."""
    model = GPT2(CONFIGS[model]).init_weights(0).eval()
    if fmt != "float32":
        model = quantize_model(model, fmt)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=g).tolist()

    def call(prompts, n):
        with torch.inference_mode():
            for _ in decode_steps(
                model, prompts, SamplingParams(), max_new_tokens=n, eos_token_id=None, generator=None
            ):
                pass

    call([p[:8] for p in prompts], 2)
    start = time.perf_counter()
    call(prompts, new_tokens)
    return batch * new_tokens / (time.perf_counter() - start)


def one_run(way: str, args, fmt: str, batch: int) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if way == "1 thread":
        env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "llmcourse.bench.under_load", "--child", args.model, fmt, str(batch)]
    command += [str(args.prompt_len), str(args.new_tokens)]
    busy = subprocess.Popen(BUSY) if way.endswith("busy") else None
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return float(done.stdout.split()[-1])


def verdicts(speeds: dict) -> dict:
    """{target: (ratio, its target, met)} for one configuration's median tokens/s per way."""
    out = {}
    for name, (a, b, target) in TARGETS.items():
        ratio = speeds[a] / speeds[b]
        out[name] = (ratio, target, ratio >= target)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmcourse.bench.under_load", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2", help="a random-weight configuration of bench (default: gpt2)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds; medians (default: 3)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model, fmt, batch, prompt_len, new_tokens = args.child
        print(f"{child(model, fmt, int(batch), int(prompt_len), int(new_tokens)):.3f}")
        return 0
    configs = [(fmt, int(b)) for fmt in ("float32", "int8") for b in args.batches.split(",")]
    runs = {(fmt, b, way): [] for fmt, b in configs for way in WAYS}
    order = list(runs)
    for rep in range(args.repeats):
        for key in order if rep % 2 == 0 else order[::-1]:
            runs[key].append(one_run(key[2], args, key[0], key[1]))
    load = os.getloadavg()[0]
    print(
        f"tokens/s, {args.model} (random weights), {args.prompt_len}-token prompt + {args.new_tokens} new tokens, "
        f"the whole call; median of {args.repeats} (each run); {os.cpu_count()} CPUs; load average {load:.1f} at "
        "the end"
    )
    print("| format, batch | " + " | ".join(WAYS) + " | " + " | ".join(TARGETS) + " |")
    print("|---" * (1 + len(WAYS) + len(TARGETS)) + "|")
    for fmt, b in configs:
        speeds = {way: statistics.median(runs[fmt, b, way]) for way in WAYS}
        cells = [f"{speeds[w]:.1f} ({', '.join(f'{x:.1f}' for x in runs[fmt, b, w])})" for w in WAYS]
        checks = [f"{r:.2f} (≥ {t:g}: {'met' if ok else 'MISSED'})" for r, t, ok in verdicts(speeds).values()]
        print(f"| {fmt}, {b} | " + " | ".join(cells + checks) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
