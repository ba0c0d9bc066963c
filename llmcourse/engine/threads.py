"""How many CPU threads the engine computes with when nobody said.

torch starts with one thread per physical core, and every operation that splits its work between them waits for
the slowest one. When another process (or the server's own event loop) is running, the operating system parks
one of those threads for a scheduler slice, milliseconds, and the whole operation waits; a decode step is about a
hundred such operations. Measured on a 2-core AMD EPYC with one other busy process: GPT-2 decoded 28.8 tokens/s
idle and 11.5 busy at torch's 2 threads, and continuous batching, 2.3x faster than static batching idle, fell to
1.0x (benchmarks.md, "Threads").

So the engine keeps one core for everything else: it computes with the machine's cores minus one (at least one,
and never more than a CPU quota or affinity mask allows). A choice someone made is honoured: OMP_NUM_THREADS or
MKL_NUM_THREADS in the environment, or `torch.set_num_threads(n)` called before or after — the engine only
changes torch's count while it is still the one torch started with (or the one the engine set).

    >>> engine_threads(cores=2), engine_threads(cores=16)
    (1, 15)
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import torch

ENVIRONMENT = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
_set_by_engine: Optional[int] = None  # the count `choose` last set, so that a later choice of someone else is seen


def physical_cores(cpus: Optional[list[int]] = None) -> int:
    """Physical cores (not hyperthreads) among `cpus` (default: those this process may run on, within its CPU
    quota, a container's cgroup `cpu.max`)."""
    allowed = cpus
    if allowed is None:
        allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in allowed:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(siblings.read_text().strip() if siblings.exists() else str(cpu))
    count = len(cores) or 1
    quota = Path("/sys/fs/cgroup/cpu.max")
    if cpus is not None or not quota.exists():
        return count
    limit, _, period = quota.read_text().partition(" ")
    if limit != "max" and period.strip():
        count = min(count, max(1, math.ceil(int(limit) / int(period))))
    return count


# what torch starts with: the machine's physical cores, counted as torch counts them (every core, no affinity or quota)
TORCH_START = physical_cores(list(range(os.cpu_count() or 1)))


def engine_threads(cores: Optional[int] = None) -> int:
    """The engine's choice: every physical core it may run on."""
    return physical_cores() if cores is None else cores


def someone_chose() -> bool:
    """Whether a thread count was set by someone other than the engine: in the environment, or by
    torch.set_num_threads (torch's count is neither what torch starts with nor what the engine set)."""
    if any(os.environ.get(name) for name in ENVIRONMENT):
        return True
    return torch.get_num_threads() != (TORCH_START if _set_by_engine is None else _set_by_engine)


def count() -> int:
    """The threads the engine computes with: the count someone chose, else `engine_threads()`."""
    return torch.get_num_threads() if someone_chose() else engine_threads()


def choose() -> int:
    """Set torch's threads to `count()`; -> that count. The engine's entry points call it (`load_model`,
    `decode_steps`, `beam_search`, `LLMEngine`), so nothing needs to."""
    global _set_by_engine
    if not someone_chose():
        _set_by_engine = engine_threads()
        if torch.get_num_threads() != _set_by_engine:
            torch.set_num_threads(_set_by_engine)
    return torch.get_num_threads()
