"""Exercise checks: each compares a learner's function with the engine's.

    >>> from llmcourse.checks import check_top_k_next_tokens
    >>> from llmcourse.sampling import top_k_next_tokens
    >>> check_top_k_next_tokens(top_k_next_tokens)
    ✓ top_k_next_tokens — 26 cases
"""

from .core import Case, CheckFailed, Forbidden, run_check
from .pipeline import check_top_k_next_tokens
from .tokenization import (check_bpe_encode_chunk, check_bytes_to_unicode, check_decode, check_encode,
                           check_get_pair_counts, check_merge, check_stream_decoder, check_train_bpe)

__all__ = ["Case", "CheckFailed", "Forbidden", "check_top_k_next_tokens", "run_check",
           "check_get_pair_counts", "check_merge", "check_train_bpe", "check_bytes_to_unicode",
           "check_bpe_encode_chunk", "check_encode", "check_decode", "check_stream_decoder"]
