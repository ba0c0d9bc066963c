"""llmcourse: a GPT-2 inference engine built from parts that learners write themselves.

    >>> import llmcourse
    >>> tok = llmcourse.get_tokenizer()
    >>> model = llmcourse.load_model("path/to/gpt2-folder")             # doctest: +SKIP
    >>> llmcourse.generate_text(model, tok, "Hello", max_new_tokens=5)  # doctest: +SKIP
"""

from .config import CheckpointError, GPT2Config
from .generate import generate, generate_text, stream
from .llm_engine import LLMEngine
from .loading import load_model, save_model
from .model import GPT2, KVCache
from .parts import PartError, Parts
from .speculative import SpeculationStats
from .tokenizer import EOT, EOT_ID, StreamDecoder, get_tokenizer
from . import stubs as _stubs

_stubs.install()  # inside IPython (a chapter's notebook): a stub's NotImplementedError shows as one line

__all__ = [
    "CheckpointError",
    "EOT",
    "EOT_ID",
    "GPT2",
    "GPT2Config",
    "KVCache",
    "LLMEngine",
    "PartError",
    "Parts",
    "SpeculationStats",
    "StreamDecoder",
    "generate",
    "generate_text",
    "get_tokenizer",
    "load_model",
    "save_model",
    "stream",
]
