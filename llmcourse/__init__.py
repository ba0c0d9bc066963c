"""llmcourse: an inference engine for GPT-2 and the Llama family, built from parts that learners write themselves.

>>> import llmcourse
>>> tok = llmcourse.get_tokenizer()
>>> model = llmcourse.load_model("path/to/gpt2-folder")             # doctest: +SKIP
>>> llmcourse.generate_text(model, tok, "Hello", max_new_tokens=5)  # doctest: +SKIP
>>> llama = llmcourse.load_model("llama-shakespeare")             # doctest: +SKIP
>>> llama_tok = llmcourse.load_tokenizer("llama-shakespeare")     # doctest: +SKIP
"""

from .course import stubs as _stubs
from .engine.config import CheckpointError, GPT2Config
from .engine.generate import generate, generate_text, stream
from .engine.hf_tokenizer import HFTokenizer, load_tokenizer
from .engine.llama import Llama, LlamaConfig
from .engine.loading import load_model, save_model
from .engine.model import GPT2, KVCache
from .engine.parts import Parts
from .engine.quantize import quantize_model
from .engine.sampling import Sampler, SamplingParams
from .engine.slots import PartError
from .engine.speculative import SpeculationStats
from .engine.tokenizer import EOT, EOT_ID, StreamDecoder, get_tokenizer
from .serving.llm_engine import LLMEngine

_stubs.install()  # inside IPython (a chapter's notebook): a stub's NotImplementedError shows as one line

__all__ = [
    "CheckpointError",
    "EOT",
    "EOT_ID",
    "GPT2",
    "GPT2Config",
    "HFTokenizer",
    "KVCache",
    "LLMEngine",
    "Llama",
    "LlamaConfig",
    "PartError",
    "Parts",
    "Sampler",
    "SamplingParams",
    "SpeculationStats",
    "StreamDecoder",
    "generate",
    "generate_text",
    "get_tokenizer",
    "load_model",
    "load_tokenizer",
    "quantize_model",
    "save_model",
    "stream",
]
