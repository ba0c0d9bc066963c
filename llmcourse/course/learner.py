"""A learner's own functions in the engine: their own engine, made of their saved chapter notebooks.

The chapters are run as `llmcourse.course.progress` runs them (save the notebooks in JupyterLab first). A
function is used in the engine only if its exercise's check passes; otherwise the engine's own runs
in its slot, with one notice saying why.

    >>> engine = my_engine("chapters")                     # doctest: +SKIP
    >>> print(engine.generate_text("ROMEO:", max_new_tokens=40))         # doctest: +SKIP

    $ python -m llmcourse generate --parts chapters/ "ROMEO:"
"""

from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Optional

from llmcourse.engine.decoder import Decoder
from llmcourse.engine.generate import generate_text, stream
from llmcourse.engine.hf_tokenizer import load_tokenizer
from llmcourse.engine.loading import load_model
from llmcourse.engine.model import GPT2
from llmcourse.engine.parts import Parts
from llmcourse.engine.quantize import Quantization, quantize_model
from llmcourse.engine.roofline import Roofline
from llmcourse.engine.sampling import Sampler
from llmcourse.engine.speculative import Speculation
from llmcourse.engine.structured.structuring import Structuring
from llmcourse.engine.tokenizer import StreamDecoder, get_tokenizer
from llmcourse.serving.batching import Batching

from . import bpe
from .guards import guard, guarded
from .progress import (
    PASS_THROUGH,
    PathLike,
    default_folder,
    describe_error,
    find_chapters,
    quietly,
    read_chapter,
    refuse_to_recurse,
    run_chapter,
)

PART_SLOTS = Parts.slot_names()
SAMPLER_SLOTS = Sampler.slot_names()
CACHE_SLOTS = ("KVCache",)
ROOFLINE_SLOTS = Roofline.slot_names()  # chapters 06 and 10: the benchmarks and `predict` run them, no generation
BATCHING_SLOTS = ("left_pad", *Batching.slot_names())  # chapter 07: left_pad is generation's, the rest LLMEngine's
SPECULATION_SLOTS = Speculation.slot_names()
QUANTIZATION_SLOTS = Quantization.slot_names()
TOKENIZER_SLOTS = ("encode", "decode", "StreamDecoder")
STRUCTURING_SLOTS = Structuring.slot_names()  # chapter 13: a constraint's compilation and masked steps
# what the engine can take from a learner
ENGINE_SLOTS = (
    PART_SLOTS
    + SAMPLER_SLOTS
    + CACHE_SLOTS
    + ROOFLINE_SLOTS
    + BATCHING_SLOTS
    + SPECULATION_SLOTS
    + QUANTIZATION_SLOTS
    + TOKENIZER_SLOTS
    + STRUCTURING_SLOTS
)
# the slots of the core path, chapters 01-11, that the capstone assembles (your_pieces' default); the chapters after
# it ("Beyond the pipeline") are read where a run asks for them (`generate --parts` with a constraint)
CORE_SLOTS = tuple(n for n in ENGINE_SLOTS if n not in STRUCTURING_SLOTS)

CHAPTER_OF = {  # which chapter's exercise each slot the engine runs is (the roofline's run in no engine)
    **dict.fromkeys(("encode", "decode", "StreamDecoder"), "01_tokenization"),
    **dict.fromkeys(("embedding", "rope"), "02_embeddings"),
    **dict.fromkeys(("softmax", "attention", "split_heads", "merge_heads", "merge_attention"), "03_attention"),
    **dict.fromkeys(("layer_norm", "gelu", "linear"), "04_gpt2"),
    **dict.fromkeys(
        ("temperature", "greedy", "top_k", "top_p", "min_p", "repetition_penalty", "sample"), "05_sampling"
    ),
    "KVCache": "06_kv_cache",
    **dict.fromkeys(("left_pad", "BlockAllocator", "paged_attention", "block_hashes", "schedule"), "07_batching"),
    **dict.fromkeys(("accept_token", "verify", "speculative_round", "best_k", "prompt_lookup_draft"), "08_speculative"),
    **dict.fromkeys(
        ("quantize_int8", "dequantize_int8", "pack_int4", "unpack_int4", "quantize_int4", "dequantize_int4"),
        "09_quantization",
    ),
    "int8_linear": "09_quantization",
    **dict.fromkeys(
        (
            "rope_frequencies",
            "rms_norm",
            "swiglu",
            "grouped_attention",
            "qk_norm",
            "llama_block",
            "load_llama_checkpoint",
        ),
        "11_modern",
    ),
    **dict.fromkeys(STRUCTURING_SLOTS, "13_structured"),
}
Notify = Callable[[str], None]


# ----------------------------------------------------------------------------------------------
# The learner's functions in the engine


def learner_functions(
    folder: Optional[PathLike] = None,
    *,
    slots: Optional[tuple[str, ...]] = None,
    notify: Notify = print,
    origins: Optional[dict] = None,
) -> dict[str, Callable]:
    """The functions (and classes) of every exercise whose check passes, by name.

    `slots`: only exercises defining one of these names are checked, and each of those that cannot
    be used gets one notice saying why (the engine keeps its own there). None: every exercise,
    quietly. `origins`: filled with slot -> (chapter, exercise, why it is not used: None if it is).
    """
    folder = default_folder() if folder is None else folder
    chapters = []
    for path in find_chapters(folder):
        chapter = read_chapter(path)
        wanted = [ex for ex in chapter.exercises if ex.cell and (slots is None or set(ex.functions) & set(slots))]
        if wanted:
            chapters.append((path, chapter, wanted))
    refuse_to_recurse([path for path, _, _ in chapters])
    functions: dict[str, Callable] = {}
    if origins is not None and slots is not None:  # a chapter not there at all (not saved, not handed in)
        found = {chapter.name for _, chapter, _ in chapters}
        origins.update(
            {
                n: (c, n, f"is missing: no {c}/{c}.ipynb in {folder}")
                for n, c in CHAPTER_OF.items()
                if n in slots and c not in found
            }
        )
    for path, chapter, wanted in chapters:
        run = run_chapter(path)
        for ex in wanted:
            names = [n for n in ex.functions if slots is None or n in slots]
            result = run.result(ex)
            why = None
            if result.status == "passing":
                functions.update({n: run.namespace[n] for n in ex.functions if n in run.namespace})
            elif slots is not None:
                why = (
                    "is not written yet"
                    if result.status == "not started"
                    else f"does not pass its check ({result.reason})"
                )
                runs = "runs" if len(names) == 1 else "run"
                notify(f"{chapter.name}: {ex.grade_id} {why}; the engine's {in_words(names)} {runs} instead")
            if origins is not None:
                origins.update({n: (chapter.name, ex.grade_id, why) for n in names})
    return functions


def in_words(names: list[str]) -> str:
    """Names as a sentence lists them: 'a', 'a and b', 'a, b and c'."""
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def learner_parts(folder: Optional[PathLike] = None, *, notify: Notify = print) -> Parts:
    """The engine's parts with every part the learner has written (and whose check passes) swapped in.

    >>> model = load_model(parts=learner_parts("chapters"))     # doctest: +SKIP
    """
    mine = learner_functions(folder, slots=PART_SLOTS, notify=notify)
    notify(f"parts: yours for {', '.join(sorted(mine)) or 'none yet'}; the engine's for the rest")
    return guarded(Parts, **mine)


class LearnerTokenizer:
    """GPT-2's tokenizer made of the learner's chapter 01 functions — `encode(text, ranks)`,
    `decode(ids, vocab)`, `StreamDecoder(vocab)` — and the engine's where one is not used. It has what
    `generate_text` and `stream` use: `encode`, `decode`, `decode_single_token_bytes`, `stream_decoder`.

    Should a learner's function raise or return something unusable, the engine's takes over from then
    on, with one notice saying where it failed."""

    def __init__(self, functions: dict[str, Callable], *, notify: Notify = print):
        self.engine = get_tokenizer()
        self.ranks, self.vocab = bpe.gpt2_ranks(), bpe.gpt2_vocab()
        self.mine = {name: functions[name] for name in TOKENIZER_SLOTS if name in functions}
        self.notify = notify

    def give_up(self, name: str, problem: str) -> None:
        if self.mine.pop(name, None) is not None:
            self.notify(f"your {name} {problem}; the engine's {name} runs from now on")

    def attempt(self, name: str, fn: Callable, valid: Callable[[object], bool], *args):
        """fn(*args) (the learner's `name`), or None after giving `name` up if it fails."""
        try:
            with quietly():
                out = fn(*args)
        except PASS_THROUGH:
            raise
        except BaseException as err:
            self.give_up(name, f"raised {describe_error(err)}")
            return None
        if not valid(out):
            self.give_up(name, f"returned {type(out).__name__} {str(out)[:60]!r}, which the engine cannot use")
            return None
        return out

    def encode(self, text: str, allowed_special="all") -> list[int]:
        if "encode" in self.mine:
            ids = self.attempt(
                "encode",
                self.mine["encode"],
                lambda out: isinstance(out, list) and all(type(i) is int and i in self.vocab for i in out),
                text,
                self.ranks,
            )
            if ids is not None:
                return ids
        return self.engine.encode(text, allowed_special=allowed_special)

    def decode(self, ids: list[int]) -> str:
        if "decode" in self.mine:
            text = self.attempt("decode", self.mine["decode"], lambda out: isinstance(out, str), list(ids), self.vocab)
            if text is not None:
                return text
        return self.engine.decode(ids)

    def decode_single_token_bytes(self, token: int) -> bytes:
        return self.vocab[token]

    @property
    def n_vocab(self) -> int:
        return self.engine.n_vocab

    @property
    def special_tokens_set(self) -> set:  # (with the two above: what a constraint's vocabulary is read from)
        return self.engine.special_tokens_set

    def stream_decoder(self):
        return GuardedStreamDecoder(self)


class GuardedStreamDecoder:
    """The learner's StreamDecoder; if it fails mid-stream, the engine's carries on where it left off."""

    def __init__(self, tokenizer: LearnerTokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""
        self.mine = self.engine = None
        if "StreamDecoder" in tokenizer.mine:
            self.mine = tokenizer.attempt(
                "StreamDecoder", tokenizer.mine["StreamDecoder"], lambda out: True, tokenizer.vocab
            )
        if self.mine is None:
            self.engine = StreamDecoder(tokenizer.engine)

    def _mine(self, method: str, *args) -> Optional[str]:
        """The learner's decoder's answer; None once the engine's has taken over (caught up)."""
        if self.mine is None:
            return None
        piece = self.tokenizer.attempt(
            "StreamDecoder", getattr(self.mine, method, None), lambda out: isinstance(out, str), *args
        )
        if piece is None:
            self.mine, self.engine = None, StreamDecoder(self.tokenizer.engine)
            text = "".join(self.engine.push(i) for i in self.ids)
            return text[len(self.shown) :] if text.startswith(self.shown) else ""
        return piece

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self._mine("push", token_id) if self.mine is not None else self.engine.push(token_id)
        self.shown += piece
        return piece

    def flush(self) -> str:
        if self.mine is not None:
            piece = self._mine("flush")
            if self.mine is not None:
                return piece
            return piece + self.engine.flush()
        return self.engine.flush()


def learner_tokenizer(folder: Optional[PathLike] = None, *, notify: Notify = print) -> LearnerTokenizer:
    """A tokenizer using the learner's chapter 01 functions, for `generate_text` / `stream`.

    >>> llmcourse.generate_text(load_model(), learner_tokenizer("chapters"), "ROMEO:")    # doctest: +SKIP
    """
    tokenizer = LearnerTokenizer(learner_functions(folder, slots=TOKENIZER_SLOTS, notify=notify), notify=notify)
    notify(f"tokenizer: yours for {', '.join(sorted(tokenizer.mine)) or 'nothing yet'}; the engine's for the rest")
    return tokenizer


class Pieces(NamedTuple):
    """Everything of a learner's that the engine runs, each function guarded once (`guards.guarded`): the forward
    pass's parts, the drivers' functions by the keyword each driver takes them with (`sampler`, `kv_cache`,
    `left_pad`, `speculation` for generation; `sampler`, `batching` for `LLMEngine`), the quantization functions
    and the tokenizer; `mine`, the learner's functions by slot (unguarded), and `origins`, slot -> (chapter,
    exercise, why it is not used: None if it is) for every slot whose chapter was found."""

    parts: Parts
    functions: dict
    quantization: Quantization
    tokenizer: "LearnerTokenizer"
    mine: dict = {}
    origins: dict = {}
    structuring: Structuring = Structuring()
    read: tuple = ENGINE_SLOTS  # the slots whose chapters were read

    def install(self, model: Decoder, quantize: Optional[str] = None) -> "Engine":
        """`model` with these parts in its forward pass (quantized with these functions if `quantize`), as an
        `Engine` whose generation runs the rest."""
        model.parts = self.parts
        if quantize is not None:
            quantize_model(model, quantize, self.quantization)
        return Engine(model, self.tokenizer, self.functions)

    def engine(
        self, model="gpt2-shakespeare", *, device="auto", dtype=None, quantize: Optional[str] = None
    ) -> "Engine":
        """Your engine on `model` (a bundled name, a folder, a Hub name: read by your loader; or a model already
        loaded), quantized with your functions if `quantize`; a Llama-family checkpoint brings its own tokenizer
        (chapter 01's is GPT-2's).

            >>> engine = your_pieces("chapters").engine("llama-shakespeare")        # doctest: +SKIP
        """
        source = model
        if not isinstance(model, Decoder):  # your loader reads a Llama-family checkpoint
            model = load_model(model, device=device, dtype=dtype, parts=self.parts)
        engine = self.install(model, quantize)
        if not isinstance(model, GPT2) and not isinstance(source, Decoder):
            engine.tokenizer = load_tokenizer(source)
        return engine


def your_pieces(
    folder: Optional[PathLike] = None, *, notify: Notify = print, uses: Optional[set[str]] = None, beyond=False
) -> Pieces:
    """What `my_engine` (and `generate --parts`) runs: your parts, sampler, KV cache, batching, speculative decoding
    and quantization functions and tokenizer, with one notice for each exercise with a slot that is not used, and
    one line saying what is yours (`uses`: the slots the run will use, see `slots_used`; None: grouped by where the
    engine uses them). The chapters of the core path (01-11, what the capstone assembles); with `beyond`, those after
    the capstone too (13: structured output's functions)."""
    origins: dict = {}
    slots = ENGINE_SLOTS if beyond else CORE_SLOTS
    functions = learner_functions(folder, slots=slots, notify=notify, origins=origins)
    return pieces_of(functions, notify=notify, uses=uses, origins=origins, read=slots)


def pieces_of(
    functions: dict[str, Callable],
    *,
    notify: Notify = print,
    uses: Optional[set[str]] = None,
    origins=None,
    read: tuple = ENGINE_SLOTS,
) -> Pieces:
    """`Pieces` made of these functions by slot name (a learner's, as `learner_functions` finds them), the
    engine's own in every other slot; the notice of what is yours goes to `notify`. `read`: the slots whose
    chapters were looked for (`engine_report` reports their chapters)."""

    def table(cls, slots):
        return guarded(cls, **{n: f for n, f in functions.items() if n in slots})

    drivers = {
        "sampler": table(Sampler, SAMPLER_SLOTS),
        "speculation": table(Speculation, SPECULATION_SLOTS),
        "batching": table(Batching, Batching.slot_names()),
    }
    for slot, keyword in (("KVCache", "kv_cache"), ("left_pad", "left_pad")):
        if slot in functions:
            drivers[keyword] = guard(slot, functions[slot])
    tokenizer = LearnerTokenizer(functions, notify=notify)
    yours = [n for n in ENGINE_SLOTS if n in functions and n not in TOKENIZER_SLOTS] + sorted(tokenizer.mine)
    notify(your_engine_notice(yours, uses))
    parts, quantization = table(Parts, PART_SLOTS), table(Quantization, QUANTIZATION_SLOTS)
    structuring = table(Structuring, STRUCTURING_SLOTS)
    return Pieces(parts, drivers, quantization, tokenizer, dict(functions), dict(origins or {}), structuring, read)


# The parts only one family's forward pass runs (chapter 04's GPT-2, chapter 11's Llama family); the rest both.
GPT2_PARTS = ("layer_norm", "gelu")
LLAMA_PARTS = (
    "rope",
    "rope_frequencies",
    "rms_norm",
    "swiglu",
    "grouped_attention",
    "qk_norm",
    "llama_block",
    "load_llama_checkpoint",
)
SHARED_PARTS = tuple(n for n in PART_SLOTS if n not in GPT2_PARTS + LLAMA_PARTS)

# Where each of the learner's slots runs, in the order the notice lists them.
WHERE_USED = (
    ("every generation", SHARED_PARTS + CACHE_SLOTS + ("left_pad",) + TOKENIZER_SLOTS),
    ("every generation with GPT-2", GPT2_PARTS),
    ("every generation with a Llama-family model", LLAMA_PARTS),
    ("choosing tokens", SAMPLER_SLOTS),
    ("LLMEngine", tuple(n for n in BATCHING_SLOTS if n != "left_pad")),
    ("speculative decoding", SPECULATION_SLOTS),
    ("quantizing", tuple(n for n in QUANTIZATION_SLOTS if n != "smooth_scales")),
    ("quantizing with a calibration (quantize_model(..., calibration=ids))", ("smooth_scales",)),
    ("the roofline's formulas: `predict` and chapter 06's decode bound run them, no generation does", ROOFLINE_SLOTS),
    ("structured output: --json-schema, --regex, --choice", STRUCTURING_SLOTS),
)


def slots_used(settings: dict, model_type: str = "gpt2") -> set[str]:
    """The slots a `generate`/`stream` call with these settings (plus `quantize`, as `generate --quantize` takes
    it) runs on a model of `model_type` (config.json's): the forward pass (GPT-2's parts, or the Llama family's,
    QK-norm for Qwen3 only), the cache and left_pad always, chapter 01's tokenizer for GPT-2 (a Llama-family
    model brings its own); greedy (and the repetition penalty) or the enabled processors and sample; the
    speculative functions with a draft; the quantization functions with quantize; chapter 13's with a constraint
    (json_schema, regex or choice: `generate --json-schema` and the others)."""
    used = set(WHERE_USED[0][1])
    if model_type == "gpt2":
        used |= set(GPT2_PARTS)
    else:
        used |= set(LLAMA_PARTS) - (set() if model_type == "qwen3" else {"qk_norm"})
        used -= set(TOKENIZER_SLOTS)
    sampled = settings.get("temperature", 0) != 0 and settings.get("num_beams", 1) == 1
    used |= {"sample"} if sampled else {"greedy"}
    if settings.get("repetition_penalty", 1) != 1:
        used.add("repetition_penalty")
    if sampled:
        used |= {
            name
            for name, off in [("temperature", 1), ("top_k", 0), ("top_p", 1), ("min_p", 0)]
            if settings.get(name, off) != off
        }
    draft = settings.get("draft")
    if draft is not None:
        used |= {"accept_token", "verify", "prompt_lookup_draft" if draft == "prompt-lookup" else "speculative_round"}
        if settings.get("num_draft_tokens") == "auto":
            used.add("best_k")
    if settings.get("quantize"):  # 'int8' or 'int4': that format's functions
        used |= {n for n in QUANTIZATION_SLOTS if settings["quantize"] in n}
    if settings.get("json_schema") is not None:  # a schema is compiled to a regex first
        used |= set(STRUCTURING_SLOTS)
    elif settings.get("regex") is not None or settings.get("choice") is not None:
        used |= set(STRUCTURING_SLOTS) - {"schema_regex"}
    return used


def your_engine_notice(yours: list[str], uses: Optional[set[str]] = None) -> str:
    """The line saying which of the learner's functions the engine runs: those `uses` names (a run's
    `slots_used`), or, when the run is not known yet, all of them grouped by where the engine runs them."""
    if not yours:
        return "your engine: the engine's own parts (none of yours is used yet)"
    if uses is not None:
        shown = [n for n in yours if n in uses]
        if not shown:
            return "your engine: the engine's own parts (none of yours is used in this run)"
        return f"your engine: your {', '.join(shown)}, the engine's own for the rest"
    groups = [(where, [n for n in yours if n in names]) for where, names in WHERE_USED]
    listed = "; ".join(f"{', '.join(names)} ({where})" for where, names in groups if names)
    return f"your engine: your {listed}; the engine's own for the rest"


def engine_report(pieces: Pieces) -> str:
    """Your engine, chapter by chapter: which of its functions are yours, which are still the engine's own and why
    (not written yet, not passing its check, the chapter's notebook not found).

        >>> print(engine_report(your_pieces("chapters")))                  # doctest: +SKIP
        01_tokenization  yours: encode, decode, StreamDecoder
        02_embeddings    yours: embedding; the engine's: rope (is not written yet)
        03_attention     yours: softmax; the engine's: attention, split_heads, merge_heads (are not written yet); ...
        ...
    """
    lines = []
    for chapter in sorted({CHAPTER_OF[s] for s in pieces.read if s in CHAPTER_OF}):
        slots = [s for s, c in CHAPTER_OF.items() if c == chapter]
        yours = [s for s in slots if s in pieces.mine]
        theirs = [s for s in slots if s not in pieces.mine]
        by_reason: dict[str, list[str]] = {}  # the same reason once, for the slots it holds for
        for slot in theirs:
            why = (pieces.origins.get(slot) or (None, None, "its notebook was not found"))[2] or "not used"
            by_reason.setdefault(why, []).append(slot)
        said = [f"yours: {', '.join(yours)}"] if yours else []
        said += [f"the engine's: {', '.join(held)} ({of_several(why, len(held))})" for why, held in by_reason.items()]
        lines.append(f"{chapter:<16} {'; '.join(said)}")
    return "\n".join(lines)


# A reason as `learner_functions` gives it, said of one exercise ('is not written yet', 'does not pass its check
# (...)', 'is missing: ...'; `engine_report`'s own 'its notebook was not found'), and its start said of several slots.
SINGULAR_TO_PLURAL = (
    ("is ", "are "),
    ("does not pass its check", "do not pass their check"),
    ("its notebook", "their notebook"),
)


def of_several(why: str, count: int) -> str:
    """`why` in agreement with `count` functions: 'is not written yet', or for two or more 'are not written yet'."""
    if count > 1:
        for one, several in SINGULAR_TO_PLURAL:
            if why.startswith(one):
                return several + why.removeprefix(one)
    return why


class Engine:
    """Your engine: `model` (GPT-2 or a Llama-family model, with your parts), `tokenizer` (yours, see
    `LearnerTokenizer`; a Llama-family model's own) and `functions`, the rest of yours by the keyword each driver
    takes (`generate`, `stream`, `generate_text` and `LLMEngine` run them when given the engine where a model goes).
    `model, tokenizer = my_engine()` unpacks it."""

    def __init__(self, model: Decoder, tokenizer, functions: Optional[dict] = None):
        self.model, self.tokenizer, self.functions = model, tokenizer, dict(functions or {})

    def __iter__(self):
        return iter((self.model, self.tokenizer))

    def __repr__(self) -> str:
        return f"Engine(model={type(self.model).__name__}, functions={sorted(self.functions)})"

    def generate_text(self, prompt: str, **settings) -> str:
        """`llmcourse.generate_text` with this engine: the continuation of `prompt` as one string."""
        return generate_text(self, self.tokenizer, prompt, **settings)

    def stream(self, prompt: str, **settings) -> Iterator[str]:
        """`llmcourse.stream` with this engine: the continuation of `prompt`, piece by piece."""
        return stream(self, self.tokenizer, prompt, **settings)


def my_engine(
    folder: Optional[PathLike] = None,
    *,
    model="gpt2-shakespeare",
    device="auto",
    dtype=None,
    quantize: Optional[str] = None,
    notify: Notify = print,
) -> Engine:
    """The engine with your functions in it: every exercise with a slot in the engine (the parts of
    `llmcourse.Parts`, the sampler's functions of `llmcourse.engine.sampling.Sampler`, chapter 06's KVCache,
    chapter 07's batching functions of `llmcourse.serving.batching.Batching`, chapter 08's speculative decoding
    functions of `llmcourse.engine.speculative.Speculation`, chapter 09's quantization functions of
    `llmcourse.engine.quantize.Quantization`, and chapter 01's encode, decode
    and StreamDecoder) whose check passes. The engine's own runs wherever yours is not written yet or does not
    pass its check (one notice each).

    `folder`: your chapters (default: ./chapters, or the folder above when run from a chapter's
    notebook). `model`: what `llmcourse.load_model` takes (a bundled name, a folder, a Hub name), or
    a model already loaded. `quantize`: 'int8' or 'int4' quantizes it with your functions once installed.

        >>> engine = my_engine()                                            # doctest: +SKIP
        >>> print(engine.generate_text("ROMEO:", temperature=0.8))          # doctest: +SKIP
        >>> model, tokenizer = engine                                       # doctest: +SKIP
    """
    return your_pieces(folder, notify=notify).engine(model, device=device, dtype=dtype, quantize=quantize)
