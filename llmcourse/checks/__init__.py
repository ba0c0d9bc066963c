"""Exercise checks: each compares a learner's function with the engine's.

    >>> from llmcourse.checks import check_top_k_next_tokens
    >>> from llmcourse.sampling import top_k_next_tokens
    >>> check_top_k_next_tokens(top_k_next_tokens)
    ✓ top_k_next_tokens — 26 cases
"""

from .core import Case, CheckFailed, Forbidden, run_check
from .pipeline import check_top_k_next_tokens

__all__ = ["Case", "CheckFailed", "Forbidden", "check_top_k_next_tokens", "run_check"]
