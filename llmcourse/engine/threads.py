"""How many CPU threads the engine computes with when nobody said, and how it uses them.

The engine computes with every physical core it may run on (within an affinity mask or a container's CPU quota),
and splits its work itself: the C kernels' pool (`kernels/pool.c`: a decode step's products and attention) and
`cpu_kernels.in_column_chunks` (a prefill's products) deal out chunks that any free thread takes, the caller too,
so no thread waits for one that the operating system has parked while another process runs. torch's own parallel
regions split their work up front and wait for every thread: measured on a 2-core AMD EPYC with one other busy
process, GPT-2's 128-token prefill took 406 ms on torch's 2 threads against 106 on one, and a decode step of a
hundred such regions waited a scheduler slice again and again (benchmarks.md, "Threads"). So the engine sets
torch's own count to one thread, and its threads, after a parallel region, do not spin beside the pool's.

A choice someone made is honoured: OMP_NUM_THREADS or MKL_NUM_THREADS in the environment, or
`torch.set_num_threads(n)` called before or after (n other than the one thread the engine set): the engine then
splits its work between n threads, and torch keeps n for what runs outside the engine's forward passes.

    >>> engine_threads(cores=2), engine_threads(cores=16)
    (2, 16)
"""

from __future__ import annotations

import contextlib
import functools
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
    return _physical_cores(tuple(allowed), cpus is None)


@functools.cache
def _physical_cores(allowed: tuple[int, ...], with_quota: bool) -> int:
    cores = set()
    for cpu in allowed:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cores.add(siblings.read_text().strip() if siblings.exists() else str(cpu))
    count = len(cores) or 1
    quota = Path("/sys/fs/cgroup/cpu.max")
    if not with_quota or not quota.exists():
        return count
    limit, _, period = quota.read_text().partition(" ")
    if limit != "max" and period.strip():
        count = min(count, max(1, math.ceil(int(limit) / int(period))))
    return count


# what torch starts with: the machine's physical cores, counted as torch counts them (every core, no affinity or quota)
TORCH_START = physical_cores(list(range(os.cpu_count() or 1)))
TORCH_OWN = 1  # torch's own count while the engine chose: the engine splits its work itself


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
    """The threads the engine splits its work between: the count someone chose, else `engine_threads()`."""
    return torch.get_num_threads() if someone_chose() else engine_threads()


def choose() -> int:
    """Unless someone chose, set torch's own count to TORCH_OWN; -> `count()`. The engine's entry points call it
    (`load_model`, `decode_steps`, `beam_search`, `LLMEngine`), so nothing needs to."""
    global _set_by_engine
    if not someone_chose():
        _set_by_engine = TORCH_OWN
        if torch.get_num_threads() != TORCH_OWN:
            torch.set_num_threads(TORCH_OWN)
    return count()


@contextlib.contextmanager
def torch_computes():
    """torch's own count set to `count()` while torch does the work itself: a torch.compile'd decode step, another
    library's model in a benchmark, a measurement of the machine's bandwidth.

        >>> with torch_computes():
        ...     torch.get_num_threads() == count()
        True
    """
    before, n = torch.get_num_threads(), count()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
