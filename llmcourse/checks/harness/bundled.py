"""The bundled models that checks run learners' parts in, loaded once per process.

A check runs in a forked child (`isolate`): what the child loads dies with it. So the models are
loaded in the parent, before the first check's child is forked (`isolate.preload`), and every
child finds them in its copy of memory. A child may change its copy (install a learner's parts);
the parent's stays as loaded.

    >>> bundled_model().config.n_layer
    6
"""

from __future__ import annotations

import functools

import torch

from llmcourse.engine.loading import load_model

from . import isolate


@functools.lru_cache(maxsize=None)
def bundled_model(name: str = "gpt2-shakespeare") -> torch.nn.Module:
    """The bundled GPT-2 (or its draft, "gpt2-shakespeare-draft") on the CPU in float32, in eval mode."""
    return load_model(name, device="cpu", dtype=torch.float32)


isolate.preload(bundled_model)
isolate.preload(lambda: bundled_model("gpt2-shakespeare-draft"))
