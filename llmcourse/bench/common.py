"""What the benchmarks share: the model configurations they run with random weights, the timing helpers, the
machine they ran on, its two roofs (memory bandwidth and matmul throughput, the machine on which the engine's
`predict` judges a step, each kernel on its own roofline), the transformers twin of an engine model, writing a
section of bench.json, and the figures' style.

`speed` (the default `bench`), `serving`, `speculative` and `quantize` each import from here; nothing here
imports them.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from llmcourse.engine import threads
from llmcourse.engine.config import GPT2Config
from llmcourse.engine.loading import load_model, save_model
from llmcourse.engine.model import GPT2
from llmcourse.engine.roofline import Prediction

CONFIGS = {
    "gpt2": GPT2Config(),
    "tiny": GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256),
}


# ------------------------------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of `repeats` calls of `fn`, the device synchronized around each."""
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    return statistics.median(run_seconds(fn, repeats, device))


# ------------------------------------------------------------------------------------------------ machine


def parse_size(text: str) -> int | None:
    """Bytes in a cache size as sysfs or lscpu write it.

    >>> parse_size("49152K"), parse_size("48 MiB (1 instance)"), parse_size("1.5 MiB"), parse_size("?")
    (50331648, 50331648, 1572864, None)
    """
    m = re.match(r"\s*([\d.]+)\s*([KMG]?)(i?B)?", text)
    if not m:
        return None
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2) or " "))


def last_level_cache() -> tuple[int, int] | None:
    """(level, bytes of one instance) of the CPU's last-level cache, from sysfs or else lscpu; None if unknown."""
    caches = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            kind = (index / "type").read_text().strip()
            level, size = int((index / "level").read_text()), parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind != "Instruction" and size:
            caches.append((level, size))
    if caches:
        return max(caches)
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for level in (4, 3, 2):  # "L3 cache: 48 MiB (1 instance)": the total over the instances
        m = re.search(rf"^L{level} cache:\s*(.+?)(?:\((\d+) instances?\))?$", text, re.M)
        if m and parse_size(m.group(1)):
            return level, parse_size(m.group(1)) // int(m.group(2) or 1)
    return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine(device: torch.device, weight_bytes: int) -> dict:
    """What the figures depend on: the processor, its cores, its last-level cache, and whether the
    model's weights fit in that cache (then part of each decode step's reads come from the cache,
    not from memory, and decode can come closer to, or beyond, the memory roofline)."""
    info: dict = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads.count(),  # the engine's (torch's own count is one while it computes)
        "weights_MB": weight_bytes / 1e6,
        # other work on the machine slows every row; on a shared machine, say how busy it was
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    llc = last_level_cache()
    info.update({"llc_level": llc[0], "llc_MB": llc[1] / 2**20} if llc else {"llc_level": None, "llc_MB": None})
    if device.type == "cuda":  # on a GPU the weights stream from its memory through its L2
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0)
        info.update(
            {
                "gpu": props.name,
                "gpu_memory_GB": props.total_memory / 1e9,
                "llc_level": 2 if l2 else None,
                "llc_MB": l2 / 2**20 if l2 else None,
            }
        )
    cache = info["llc_MB"]
    info["weights_in_llc"] = None if cache is None else min(1.0, cache * 2**20 / weight_bytes)
    info["weights_fit_in_llc"] = None if cache is None else cache * 2**20 >= weight_bytes
    return info


def describe_machine(m: dict) -> str:
    """One line: the processor and how much of the model its last-level cache holds.

    >>> describe_machine({"cpu": "Xeon", "cores": 2, "threads": 2, "weights_MB": 498.0, "llc_level": 3,
    ...                   "llc_MB": 48.0, "weights_in_llc": 0.101, "weights_fit_in_llc": False})
    'Xeon, 2 cores, 2 threads; L3 cache 48 MB: the 498 MB of weights do not fit (it holds 10% of them)'
    """
    where = m.get("gpu") or m["cpu"]
    cores = "" if "gpu" in m else f", {m['cores']} cores, {m['threads']} threads"
    if m["llc_MB"] is None:
        return f"{where}{cores}; last-level cache unknown ({m['weights_MB']:.0f} MB of weights)"
    fit = "fit in it" if m["weights_fit_in_llc"] else f"do not fit (it holds {m['weights_in_llc']:.0%} of them)"
    load = f"; load average {m['load_average']:.1f} at the start" if m.get("load_average") is not None else ""
    return (
        f"{where}{cores}; L{m['llc_level']} cache {m['llc_MB']:.0f} MB: the {m['weights_MB']:.0f} MB of weights "
        f"{fit}{load}"
    )


# ----------------------------------------------------------------------------------------------- roofline


def bandwidth_runs(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> list[float]:
    """Bytes per second read from memory in each of `repeats` sums of a large array, as decode streams its weights:
    the best and the spread of the runs say how steady the machine is; `measure_bandwidth` takes their median.

    The array must be far bigger than the last-level cache: `speed.run` and `quantize.run` pass at least 4x its
    size.

        >>> runs = bandwidth_runs(torch.device("cpu"), megabytes=8, repeats=3)
        >>> len(runs), all(r > 0 for r in runs)
        (3, True)
    """
    x = torch.ones(megabytes * 2**20 // 4, device=device)
    return [x.numel() * 4 / s for s in run_seconds(lambda: x.sum(), repeats, device)]


def measure_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second read from memory: the median of `bandwidth_runs`."""
    return statistics.median(bandwidth_runs(device, megabytes, repeats))


def matmul_runs(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> list[float]:
    """FLOP/s of each of `repeats` products of two square matrices, at most `size` wide; `measure_matmul` takes
    their median.

    The size doubles from 256 while a product takes under 50 ms: on a CPU without native float16
    arithmetic a 2048-wide float16 product takes minutes.

        >>> runs = matmul_runs(torch.device("cpu"), torch.float32, size=256, repeats=3)
        >>> len(runs), all(r > 0 for r in runs)
        (3, True)
    """
    n = 256
    while True:
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
        if n >= size or median_seconds(lambda: a @ b, 1, device) > 0.05:
            break
        n *= 2
    a @ b
    return [2 * n**3 / s for s in run_seconds(lambda: a @ b, repeats, device)]


def measure_matmul(device: torch.device, dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matrix product: the median of `matmul_runs`."""
    return statistics.median(matmul_runs(device, dtype, size, repeats))


def bound_of(prediction: Prediction) -> str:
    """Which limit bounds a step the engine's `predict` judged kernel by kernel: "memory" when every kernel waits on
    memory, "compute" when every kernel that does arithmetic waits on it, "mixed" otherwise (at a large decode
    batch: the weight products compute-bound, attention memory-bound; `Prediction.compute_bound` names them).

        >>> from llmcourse.engine.roofline import SHAPES, predict
        >>> [bound_of(predict(SHAPES["Llama-3-8B"], (989e12, 3.35e12), batch=b, context=1024)) for b in (1, 1024)]
        ['memory', 'mixed']
    """
    compute = set(prediction.compute_bound())
    if not compute:
        return "memory"
    arithmetic = {k.name for k in prediction.kernels if k.flops}
    return "compute" if arithmetic <= compute else "mixed"


# ------------------------------------------------------------------------------------------------- models


def load(name: str, device: torch.device, dtype: torch.dtype):
    """A model by name: a configuration of `CONFIGS` with random weights, or a model `load_model` finds. Either way
    torch's threads become the engine's choice unless someone chose (`llmcourse.engine.threads`)."""
    threads.choose()
    if name in CONFIGS:  # a configuration: random weights (the timings do not depend on their values)
        return GPT2(CONFIGS[name]).init_weights(0).to(device, dtype).eval().requires_grad_(False)
    return load_model(name, device=device, dtype=dtype)


def transformers_twin(model: GPT2):
    """transformers' GPT2LMHeadModel with the same weights (through a saved folder, as a user would)."""
    # heavy and optional (the course extra): only when comparing with transformers
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        save_model(model, folder)
        return GPT2LMHeadModel.from_pretrained(folder, dtype=model.dtype).to(model.device).eval()


# ------------------------------------------------------------------------------------------------ results


def measure_and_save(out: Path, name: str, measure: Callable[[], dict], report: Callable[[dict], Path]) -> int:
    """`bench --NAME`'s main: `measure()` (a ValueError, a bad setting, is one line on stderr and exit status 2),
    then `save_section` with `report(results)`."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        results = measure()
    except ValueError as err:
        print(f"python -m llmcourse bench: error: {err}", file=sys.stderr)
        return 2
    return save_section(out, name, results, lambda: report(results))


def save_section(out: Path, name: str, results: dict, report: Callable[[], Path]) -> int:
    """Write `results` as section `name` of out/bench.json (keeping its other sections), then `report()` (print
    the table, draw the figure, return its path; it may add derived figures to `results`). A bug in reporting
    loses no measurement: they are written first."""
    path = out / "bench.json"
    whole = json.loads(path.read_text()) if path.exists() else {}
    whole[name] = results
    path.write_text(json.dumps(whole, indent=2) + "\n")
    try:
        figure = report()
    except Exception:
        sys.stdout.flush()
        traceback.print_exc()
        print(
            f"python -m llmcourse bench: error: could not report the {name} benchmark; the measurements are in {path}",
            file=sys.stderr,
        )
        return 1
    path.write_text(json.dumps(whole, indent=2) + "\n")
    print(f"wrote the {name} section of {path} and {figure}")
    return 0


# ------------------------------------------------------------------------------------------------ figures

# Readable on a phone (about 400 px wide): large type, few ticks.
STYLE = {
    "font.size": 15,
    "axes.titlesize": 16,
    "axes.labelsize": 15,
    "xtick.labelsize": 14,
    "ytick.labelsize": 14,
    "legend.fontsize": 13,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
}
FIGSIZE, DPI = (5.6, 4.2), 150  # 840 x 630 pixels
ENGINE, COMPILED, TRANSFORMERS, ROOF = "C0", "C2", "C1", "#888"


def save(fig, path: Path) -> Path:
    """Write the figure `fig` to `path` (at `DPI`) and close it."""
    import matplotlib.pyplot as plt  # heavy and optional (the course extra): only when plotting

    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
