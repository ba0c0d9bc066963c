"""Exercise checks: each compares a learner's function with the engine's.

    >>> import torch
    >>> from llmcourse.checks import check_top_k_next_tokens
    >>> def top_k_next_tokens(logits, k):
    ...     probs = torch.softmax(logits.float(), dim=-1)
    ...     order = torch.argsort(probs, descending=True, stable=True)
    ...     return [(int(i), float(probs[i])) for i in order[:k]]
    >>> check_top_k_next_tokens(top_k_next_tokens)
    ✓ top_k_next_tokens — 35 cases

What every check gets from the shared machinery (order-aware comparison, inputs that must not
change, black boxes caught however they are reached, nestable time limits, bounded messages) is
described in `llmcourse.checks.harness.core`.
"""

import sys

from llmcourse.course.limits import time_limit

from .attention import (
    check_attention,
    check_causal_mask,
    check_merge_attention,
    check_merge_heads,
    check_self_attention,
    check_softmax,
    check_split_heads,
    check_tiled_attention,
)
from .batching import (
    check_block_allocator,
    check_block_hashes,
    check_left_pad,
    check_paged_attention,
    check_schedule,
)
from .embeddings import check_embed, check_embedding, check_rope, check_sinusoidal_positions
from .gpt2 import (
    check_block,
    check_gelu,
    check_gpt2_forward,
    check_layer_norm,
    check_linear,
    check_load_gpt2_checkpoint,
    check_mlp,
)
from .harness import bundled, isolate  # noqa: F401 (bundled registers the models every check's child finds loaded
from .harness.core import Case, CheckFailed, later, run_check
from .harness.forbid import NOT_ENFORCEABLE, Forbidden, ForbiddenCall
from .kv_cache import (
    check_cached_attention,
    check_decode_step,
    check_generate_greedy,
    check_kv_cache,
    check_max_sequences,
)
from .modern import (
    check_grouped_attention,
    check_llama_block,
    check_load_llama_checkpoint,
    check_qk_norm,
    check_repeat_kv,
    check_rms_norm,
    check_rope_frequencies,
    check_swiglu,
)
from .pipeline import check_top_k_next_tokens
from .quantize import (
    check_int8_linear,
    check_pack_int4,
    check_quantize_int4,
    check_quantize_int8,
    check_smooth_scales,
    check_smoothing_error,
)
from .roofline import (
    check_attention_cost,
    check_critical_batch,
    check_gemm_cost,
    check_gpu_roof,
    check_matrix_bytes,
    check_roofline_time,
    check_step_time,
    check_utilization,
)
from .sampling import (
    check_beam_search,
    check_greedy,
    check_min_p,
    check_next_token,
    check_repetition_penalty,
    check_sample,
    check_stream_text,
    check_temperature,
    check_top_k,
    check_top_p,
)
from .speculative import (
    check_accept_token,
    check_best_k,
    check_expected_speedup,
    check_expected_tokens,
    check_prompt_lookup_draft,
    check_speculative_round,
    check_verify,
)
from .structured import check_mask_logits, check_schema_regex, check_token_index, check_walk_token
from .tokenization import (
    check_bpe_encode_chunk,
    check_bytes_to_unicode,
    check_decode,
    check_encode,
    check_get_pair_counts,
    check_merge,
    check_stream_decoder,
    check_train_bpe,
)

__all__ = [
    "Case",
    "CheckFailed",
    "later",
    "Forbidden",
    "ForbiddenCall",
    "NOT_ENFORCEABLE",
    "check_top_k_next_tokens",
    "run_check",
    "time_limit",
    "check_get_pair_counts",
    "check_merge",
    "check_train_bpe",
    "check_bytes_to_unicode",
    "check_bpe_encode_chunk",
    "check_encode",
    "check_decode",
    "check_stream_decoder",
    "check_embedding",
    "check_embed",
    "check_sinusoidal_positions",
    "check_rope",
    "check_softmax",
    "check_causal_mask",
    "check_attention",
    "check_split_heads",
    "check_merge_heads",
    "check_self_attention",
    "check_tiled_attention",
    "check_merge_attention",
    "check_layer_norm",
    "check_gelu",
    "check_linear",
    "check_mlp",
    "check_block",
    "check_gpt2_forward",
    "check_load_gpt2_checkpoint",
    "check_temperature",
    "check_greedy",
    "check_top_k",
    "check_top_p",
    "check_min_p",
    "check_repetition_penalty",
    "check_sample",
    "check_next_token",
    "check_beam_search",
    "check_stream_text",
    "check_kv_cache",
    "check_cached_attention",
    "check_generate_greedy",
    "check_decode_step",
    "check_max_sequences",
    "check_left_pad",
    "check_block_allocator",
    "check_block_hashes",
    "check_paged_attention",
    "check_schedule",
    "check_accept_token",
    "check_verify",
    "check_speculative_round",
    "check_expected_tokens",
    "check_expected_speedup",
    "check_best_k",
    "check_prompt_lookup_draft",
    "check_quantize_int8",
    "check_pack_int4",
    "check_quantize_int4",
    "check_int8_linear",
    "check_smooth_scales",
    "check_smoothing_error",
    "check_gpu_roof",
    "check_matrix_bytes",
    "check_gemm_cost",
    "check_attention_cost",
    "check_roofline_time",
    "check_step_time",
    "check_critical_batch",
    "check_utilization",
    "check_rms_norm",
    "check_swiglu",
    "check_repeat_kv",
    "check_grouped_attention",
    "check_qk_norm",
    "check_rope_frequencies",
    "check_llama_block",
    "check_load_llama_checkpoint",
    "check_walk_token",
    "check_token_index",
    "check_mask_logits",
    "check_schema_regex",
]


def _isolate_every_check() -> None:
    """Every exercise check runs in a child process of its own (`isolate`): wrapped here, where the
    modules' functions are gathered, so that a chapter's module needs nothing for it."""
    for name in __all__:
        fn = globals()[name]
        if name.startswith("check_") and not getattr(fn, "isolated", False):
            wrapped = isolate.isolated(fn)
            globals()[name] = wrapped
            setattr(sys.modules[fn.__module__], name, wrapped)


_isolate_every_check()
