"""Checks for chapter 02, embeddings and positions: `embedding`, `embed`, `sinusoidal_positions`, `rope`.

Each compares the learner's function with the engine's (`llmcourse.engine.parts.embedding`,
`llmcourse.engine.positions`) on fixed edge cases and seeded random ones, and when an answer is wrong it
also tries the usual mistakes on the same input: if one of them gives the learner's answer, the
message names it.

    >>> def embedding(weight, ids):
    ...     return weight[ids]
    >>> check_embedding(embedding)
    ✓ embedding — 27 cases
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from llmcourse.course.failed import CheckFailed
from llmcourse.course.guards import guarded
from llmcourse.engine import positions
from llmcourse.engine.padding import left_pad
from llmcourse.engine.parts import Parts
from llmcourse.engine.parts import embedding as engine_embedding
from llmcourse.engine.slots import PartError

from .harness import isolate
from .harness.bundled import bundled_model
from .harness.core import Case, call_learner, failure, later, run_check
from .harness.forbid import Forbidden
from .harness.tensors import Mistake, tensor_judge

LOOK_IT_UP = "Index the rows yourself: weight[ids] picks row ids[b, t] for every position."
NO_EMBEDDING = [
    Forbidden("torch.nn.functional.embedding", LOOK_IT_UP),
    Forbidden("torch.nn.Embedding", LOOK_IT_UP),
    Forbidden("torch.embedding", LOOK_IT_UP),  # every route: torch.embedding, torch.ops.aten.embedding, ...
    Forbidden("torch.embedding_bag", LOOK_IT_UP),
    Forbidden("llmcourse.engine.parts.embedding", "Write your own."),
    Forbidden("llmcourse.engine.model", "Write your own."),
    Forbidden("transformers", LOOK_IT_UP),
]
NO_POSITIONS = [
    Forbidden("llmcourse.engine.positions", "Write your own."),
    Forbidden("transformers", "Write your own: it is a few lines of torch."),
]


def _exact(case: Case) -> tuple[float, float]:
    return 0.0, 0.0


NOT_CONTIGUOUS = (
    "the input is a non-contiguous view here, as the engine passes it (position ids are "
    "arange(T).expand(B, T); q and k come from split_heads' transpose): .view() cannot reshape "
    "it, use .reshape() (or .contiguous().view()), or index without flattening"
)
HALF_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# Every engine slot's check ends by running the learner's part inside the engine, installed as
# `llmcourse.course.learner.my_engine` installs it (guarded(Parts, ...)), so that a part that passes its
# check cannot then fail in the engine (an interface the cases do not reach: a keyword argument, a
# non-contiguous view, a buffer reused between calls, a dtype).

ENGINE_PROMPT_LENGTHS = (48, 29)  # a left-padded batch, short: a check pays for the model's load and two runs


def _engine_model():
    return bundled_model()


def _engine_batch() -> list[list[int]]:
    g = torch.Generator().manual_seed(2024)
    batch = [torch.randint(0, 50257, (n,), generator=g).tolist() for n in ENGINE_PROMPT_LENGTHS]
    batch[0][20] = batch[1][-1] = 50256  # <|endoftext|> inside a prompt is a real token
    return batch


def _engine_steps(model, batch: list[list[int]]) -> list[Tensor]:
    """What `generate` asks of the model: a prompt alone (position_ids and mask None), then a left-padded
    batch with a KV cache (prefill, then two decoding steps at each row's own position). The logits of
    each step, float64."""

    with torch.no_grad():
        steps = [model(torch.tensor([batch[0]]))[0]]  # [T, V]
        ids, prompt_mask, pos = left_pad(batch)
        B, L = ids.shape
        mask = torch.cat([prompt_mask, torch.ones(B, 2, dtype=torch.long)], dim=1)
        cache = model.new_cache(B, L + 2)
        steps.append(model(ids, position_ids=pos, attention_mask=prompt_mask, cache=cache, last_only=True)[:, -1])
        next_pos = pos[:, -1:] + 1
        for step, token in enumerate(([11, 13], [262, 50256])):
            steps.append(
                model(
                    torch.tensor(token)[:, None],
                    position_ids=next_pos,
                    attention_mask=mask[:, : L + step + 1],
                    cache=cache,
                )[:, -1]
            )
            next_pos = next_pos + 1
    return [t.double() for t in steps]


@isolate.preload
@functools.lru_cache(maxsize=1)
def _engine_expected() -> list[Tensor]:
    return _engine_steps(_engine_model(), _engine_batch())


ENGINE_STEPS = (
    f"a prompt of {ENGINE_PROMPT_LENGTHS[0]} tokens (position_ids=None, no mask)",
    f"a left-padded batch of 2 prompts ({ENGINE_PROMPT_LENGTHS[0]} and {ENGINE_PROMPT_LENGTHS[1]} tokens) "
    "with a KV cache",
    "the first decoding step (one token per row, each at its own position)",
    "the second decoding step",
)


def check_in_engine(
    name: str, fn: Callable, forbid: Sequence[Forbidden], *, hint: str = "", seconds: float = 20.0
) -> None:
    """Run the engine's GPT-2 (the bundled model) with the learner's part `name` swapped in as `my_engine`
    does, through what `generate` asks of it; raise CheckFailed if the part raises, returns what the engine
    cannot use, or moves the logits.

    Accuracy: the engine's float32 logits differ from float64 ones by about 1e-5; a float32 part is accepted
    within 1e-3 of the largest logit (100 times that), while a wrong part moves them by far more."""

    expected, batch, model = _engine_expected(), _engine_batch(), _engine_model()
    tolerance = 1e-3 * max(float(t.abs().max()) for t in expected)
    what = "the bundled GPT-2 (float32)"

    def run():
        saved = model.parts
        model.parts = guarded(Parts, **{name: fn})
        try:
            return _engine_steps(model, batch)
        except PartError as err:
            return err
        finally:
            model.parts = saved

    got = call_learner(
        name,
        run,
        (),
        forbid=forbid,
        seconds=seconds,
        show=lambda args: f"{what} with your {name} in it (as my_engine installs it)",
    )
    if isinstance(got, Exception):
        text = str(got).split("\n  hint:")[0]
        raise CheckFailed(
            f"✗ {name} in the engine — {what}, with your {name} in it: {text}" + (f"\n  hint: {hint}" if hint else "")
        ) from None
    for step, (g, e) in enumerate(zip(got, expected)):
        off = float((g - e).abs().nan_to_num(float("inf")).max())
        if off > tolerance:
            raise failure(
                f"{name} in the engine",
                f"{what}, {ENGINE_STEPS[step]}",
                f"the logits differ from the engine's by up to {off:.3g} (expected within {tolerance:.3g}, "
                "1e-3 of the largest logit)",
                f"{what} with your {name}",
                e,
                g,
                [
                    hint,
                    f"your {name} passes the cases above but not the engine's own calls: look at how "
                    "the engine calls it (non-contiguous views, masks of shape [B, 1, T, keys], a result "
                    "kept while the next call runs)",
                ],
            )


def _far_from_zero(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """Random values of a random spread, shifted away from 0 (some cases)."""
    scale = float(torch.tensor([0.02, 1.0, 30.0])[torch.randint(0, 3, (1,), generator=g)])
    shift = float(torch.randint(-50, 51, (1,), generator=g)) if torch.rand(1, generator=g) < 0.4 else 0.0
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


def _randint(g: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high + 1, (1,), generator=g))


# ----------------------------------------------------------------------------------------------
# Exercise 1: embedding(weight, ids)


def _table(n: int, c: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Row r is r + 0.01·[0, 1, ..., c-1]: a row's values say which row it is."""
    return (torch.arange(n, dtype=torch.float64)[:, None] + 0.01 * torch.arange(c, dtype=torch.float64)).to(dtype)


EMBEDDING_MISTAKES: list[Mistake] = [
    (
        lambda weight, ids: weight[ids.flatten()],
        "keep the shape of ids: the result is ids.shape + (C,), e.g. [B, T] ids give [B, T, C]",
    ),
    (lambda weight, ids: weight[ids - 1], "ids count from 0: id 0 is row 0 (weight[0]), not row 1"),
    (
        lambda weight, ids: weight[ids[:1]].expand(*ids.shape, -1) if ids.dim() > 1 else weight[ids],
        "every row of the batch has its own ids: look up ids[b] for each b, not ids[0] for all",
    ),
    (
        lambda weight, ids: weight.float()[ids],
        "keep weight's dtype: a float64, float16 or bfloat16 table gives rows of that dtype (no .float())",
    ),
    (
        lambda weight, ids: weight[ids.to(torch.int16).long()],
        "keep the ids as they are (long): int16 holds ids only up to 32767 and GPT-2's go to 50256",
    ),
]
EMBEDDING_ERROR_HINTS = {
    "view size is not compatible": NOT_CONTIGUOUS,
    "must match the size": "the table has N rows and C columns: build nothing of a fixed size (GPT-2's 50257 or "
    "768), take the sizes from weight and ids",
}
NO_EMBEDDING_IN_ENGINE = [f for f in NO_EMBEDDING if not f.target.startswith("llmcourse.")]  # the engine runs


def _embedding_case(description: str, weight: Tensor, ids: Tensor, hint: str = "") -> Case:
    return Case(description, (weight, ids), later(engine_embedding, weight, ids), hint)


def check_embedding(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """embedding(weight [N, C], ids (long, any shape, e.g. [B, T])) -> [*ids.shape, C]: the rows of weight.

    Also as the engine calls it: GPT-2's token table (50257 rows) and position table (1024 rows) with
    position ids arange(T).expand(B, T) (a non-contiguous view), float16 / bfloat16 tables; then inside the
    engine (`check_in_engine`)."""
    w = _table(6, 3)
    big = _table(50257, 4)
    wpe = _table(1024, 8)
    same_shape = 1000 + _table(6, 3)  # the same shape as w: a result cached by ids alone shows here
    cases = [
        _embedding_case("a small example", w, torch.tensor([[2, 0, 5]])),
        _embedding_case("ids of one dimension [T] give [T, C]", w, torch.tensor([1, 4])),
        _embedding_case(
            "a batch of two rows with different ids",
            w,
            torch.tensor([[1, 2, 3], [5, 4, 0]]),
            "look up every row of the batch",
        ),
        _embedding_case("the same id several times", w, torch.tensor([[3, 3, 3, 3]])),
        _embedding_case("the first and the last row", w, torch.tensor([[0], [5]])),
        _embedding_case(
            "the same ids as the first case, another table of the same shape",
            same_shape,
            torch.tensor([[2, 0, 5]]),
            "look the rows up in the table you are given now: nothing may be kept from an earlier call",
        ),
        _embedding_case("a single id, shape [1, 1]", w, torch.tensor([[4]])),
        _embedding_case(
            "ids of three dimensions [2, 2, 3]", w, torch.tensor([[[0, 1, 2], [3, 4, 5]], [[5, 5, 0], [1, 1, 2]]])
        ),
        _embedding_case(
            "float64 weights stay float64",
            _table(5, 4, torch.float64),
            torch.tensor([[4, 0], [2, 3]]),
            "float64 in, float64 out",
        ),
        _embedding_case(
            "float16 weights stay float16",
            _table(7, 5, torch.float16),
            torch.tensor([[6, 0], [2, 3]]),
            "float16 in, float16 out (the engine runs in float16 on a GPU)",
        ),
        _embedding_case(
            "bfloat16 weights stay bfloat16",
            _table(7, 5, torch.bfloat16),
            torch.tensor([[1, 6, 2]]),
            "bfloat16 in, bfloat16 out",
        ),
        _embedding_case("GPT-2's vocabulary (50257 rows), the last id", big, torch.tensor([[0, 50256, 13, 50256]])),
        _embedding_case(
            "GPT-2's vocabulary, ids past 255 and past 32767",
            big,
            torch.tensor([[256, 300, 32767, 32768, 40000, 50255]]),
            "ids go up to 50256: keep them long (uint8 / int16 ids wrap around)",
        ),
        _embedding_case(
            "positions as the engine passes them: arange(300).expand(2, 300), a non-contiguous view",
            wpe,
            torch.arange(300).expand(2, 300),
            NOT_CONTIGUOUS,
        ),
        _embedding_case(
            "the last token of each row, ids[:, -1:] (a slice, not contiguous)",
            big,
            torch.tensor([[5, 50256, 7], [9, 10, 40000]])[:, -1:],
        ),
        _embedding_case(
            "ids transposed (a non-contiguous view) [3, 2]", _table(50, 3), torch.tensor([[1, 2, 3], [40, 41, 42]]).T
        ),
        _embedding_case(
            "negative and large values in the table",
            torch.tensor([[-1e4, 2.5], [7.0, -0.001], [1e6, -3e5]]),
            torch.tensor([[2, 0], [1, 2]]),
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float16, torch.float32, torch.bfloat16]
    for i in range(n_random):
        n, c = _randint(g, 1, 3000), _randint(g, 1, 48)
        dims = _randint(g, 1, 3)
        shape = tuple(_randint(g, 1, 6) for _ in range(dims))
        dtype = dtypes[i % len(dtypes)]
        weight = _far_from_zero(g, (n, c), dtype)
        ids = torch.randint(0, n, shape, generator=g)
        if i % 4 == 3 and dims > 1:  # a view, as the engine's sliced or expanded ids are
            ids = ids.transpose(0, -1)
        cases.append(_embedding_case(f"random #{i} ({n} rows of {c}, ids {list(ids.shape)}, {dtype})", weight, ids))
    run_check(
        "embedding",
        fn,
        cases,
        judge=tensor_judge(_exact, EMBEDDING_MISTAKES),
        forbid=NO_EMBEDDING,
        error_hints=EMBEDDING_ERROR_HINTS,
        timeout_hint="index the table with all the ids at once: weight[ids] (a Python loop over "
        "50,257 rows or over every id is too slow)",
    )
    check_in_engine(
        "embedding",
        fn,
        NO_EMBEDDING_IN_ENGINE,
        hint="the engine looks up wte.weight with input_ids and wpe.weight with position_ids "
        "(arange(T).expand(B, T), or each row's own positions)",
    )


# ----------------------------------------------------------------------------------------------
# Exercise 2: embed(wte, wpe, input_ids, position_ids=None)


def reference_embed(wte: Tensor, wpe: Tensor, input_ids: Tensor, position_ids: Optional[Tensor] = None) -> Tensor:
    """GPT-2's input: token embedding + position embedding, [B, T] ids -> [B, T, C]."""
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[-1]).expand_as(input_ids)  # [B, T]: 0 .. T-1 in every row
    return engine_embedding(wte, input_ids) + engine_embedding(wpe, position_ids)


def _default_positions(input_ids: Tensor) -> Tensor:
    return torch.arange(input_ids.shape[-1]).expand_as(input_ids)


def _eos_as_padding(ids: Tensor) -> Tensor:
    return ((ids != 50256).long().cumsum(-1) - 1).clamp(min=0)


EMBED_MISTAKES: list[Mistake] = [
    (
        lambda wte, wpe, ids, pos=None: wte[ids] + wpe[_default_positions(ids)],
        "use position_ids when they are given: with left padding or a cache, a row's positions are not 0, 1, 2, ...",
    ),
    (
        lambda wte, wpe, ids, pos=None: wte[ids] + wpe[(pos if pos is not None else _default_positions(ids)) + 1],
        "positions count from 0: the first token is at position 0 (wpe[0])",
    ),
    (
        lambda wte, wpe, ids, pos=None: wte[ids] + wpe[_default_positions(ids) + 1],
        "positions count from 0: the first token is at position 0 (wpe[0])",
    ),
    (
        lambda wte, wpe, ids, pos=None: wte[ids] + wpe[(pos if pos is not None else _default_positions(ids))[0]],
        "every row has its own positions: use position_ids[b] for row b, not position_ids[0] for all",
    ),
    (
        lambda wte, wpe, ids, pos=None: torch.cat(
            [wte[ids], wpe[pos if pos is not None else _default_positions(ids)]], -1
        ),
        "add the two embeddings (same size C), do not concatenate them",
    ),
    (lambda wte, wpe, ids, pos=None: wte[ids], "add the position embedding wpe[position_ids] to the token embedding"),
    (
        lambda wte, wpe, ids, pos=None: wte[ids] + wpe[pos if pos is not None else _eos_as_padding(ids)],
        "position_ids=None means 0, 1, ..., T-1 whatever the tokens are: <|endoftext|> (50256) inside the text is a "
        "real token, not padding",
    ),
    (
        lambda wte, wpe, ids, pos=None: wte[ids] + wpe[(pos if pos is not None else _default_positions(ids)) % 256],
        "positions go past 255 (GPT-2 has 1024): keep them long (torch.arange(T) is int64; uint8 wraps at 256)",
    ),
    (
        lambda wte, wpe, ids, pos=None: (
            wte.float()[ids] + wpe.float()[pos if pos is not None else _default_positions(ids)]
        ),
        "keep the tables' dtype: float16 / bfloat16 / float64 tables give a sum of that dtype (no .float())",
    ),
]
EMBED_ERROR_HINTS = {
    "missing 1 required positional argument": "position_ids is optional: def embed(wte, wpe, input_ids, "
    "position_ids=None), and the engine calls embed(wte, wpe, input_ids)",
    "view size is not compatible": NOT_CONTIGUOUS,
}


def _embed_case(
    description: str,
    wte: Tensor,
    wpe: Tensor,
    ids: Tensor,
    pos: Optional[Tensor],
    hint: str = "",
    *,
    as_engine: bool = False,
) -> Case:
    """as_engine: called without position_ids at all, as the engine does (a wrong default fails)."""
    args = (wte, wpe, ids) if as_engine else (wte, wpe, ids, pos)
    return Case(description, args, later(reference_embed, *args), hint)


def _embed_tolerance(case: Case) -> tuple[float, float]:
    """A sum of two rows, rounded once to the tables' dtype: any order or precision of the addition is within
    one rounding (float16 / bfloat16: its eps relative)."""
    dtype = case.expected.dtype
    return (0.0, torch.finfo(dtype).eps) if dtype in HALF_DTYPES else (0.0, 1e-6)


def check_embed(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """embed(wte [V, C], wpe [P, C], input_ids [B, T], position_ids [B, T] or None) -> [B, T, C].

    Also as the engine calls it, embed(wte, wpe, input_ids) (no position_ids), with GPT-2's tables (50257
    tokens, 1024 positions), <|endoftext|> inside the text, non-contiguous ids, float16 / bfloat16."""
    wte = _table(10, 4)
    wpe = 100 * _table(8, 4)  # positions in the hundreds, tokens in the units: a sum shows both
    gpt2_wte, gpt2_wpe = _table(50257, 4), 1e5 * _table(1024, 4)
    g0 = torch.Generator().manual_seed(7)
    long_ids = torch.randint(0, 50257, (2, 300), generator=g0)
    eos = torch.tensor([[464, 50256, 318, 50256, 50256, 11], [50256, 50256, 3, 4, 5, 6]])
    cases = [
        _embed_case(
            "a small example, position_ids=None (positions 0, 1, 2)",
            wte,
            wpe,
            torch.tensor([[3, 1, 4]]),
            None,
            "position_ids=None means 0, 1, ..., T-1 in every row",
        ),
        _embed_case(
            "called as the engine calls it: embed(wte, wpe, input_ids), no position_ids",
            wte,
            wpe,
            torch.tensor([[3, 1, 4], [2, 7, 1]]),
            None,
            "position_ids is optional: default None",
            as_engine=True,
        ),
        _embed_case("a batch of two, position_ids=None", wte, wpe, torch.tensor([[3, 1, 4, 1], [5, 9, 2, 6]]), None),
        _embed_case("explicit position_ids 0..T-1", wte, wpe, torch.tensor([[7, 7]]), torch.tensor([[0, 1]])),
        _embed_case(
            "left padding: each row has its own position_ids",
            wte,
            wpe,
            torch.tensor([[0, 0, 5, 3], [2, 7, 5, 3]]),
            torch.tensor([[0, 0, 0, 1], [0, 1, 2, 3]]),
            "row 0 has two padding tokens, so its first real token is at position 0",
        ),
        _embed_case(
            "decoding one token at position 6 (and 2 in the other row)",
            wte,
            wpe,
            torch.tensor([[9], [4]]),
            torch.tensor([[6], [2]]),
            "with a cache, the new token's position is how many tokens came before it",
        ),
        _embed_case(
            "float64 tables stay float64",
            wte.double(),
            wpe.double(),
            torch.tensor([[1, 2], [3, 4]]),
            torch.tensor([[5, 6], [0, 1]]),
            "float64 in, float64 out",
        ),
        _embed_case(
            "float16 tables stay float16",
            wte.half(),
            wpe.half(),
            torch.tensor([[1, 2], [3, 4]]),
            None,
            "float16 in, float16 out (the engine runs in float16 on a GPU)",
        ),
        _embed_case(
            "bfloat16 tables stay bfloat16",
            wte.bfloat16(),
            wpe.bfloat16(),
            torch.tensor([[9, 0, 3]]),
            torch.tensor([[4, 5, 6]]),
            "bfloat16 in, bfloat16 out",
        ),
        _embed_case("the last position of the table", wte, wpe, torch.tensor([[1, 2, 3]]), torch.tensor([[5, 6, 7]])),
        _embed_case(
            "<|endoftext|> (50256) inside the text, position_ids=None",
            gpt2_wte,
            gpt2_wpe,
            eos,
            None,
            "every token is at its own position 0 .. T-1, <|endoftext|> too",
            as_engine=True,
        ),
        _embed_case(
            "GPT-2's tables, 300 tokens, position_ids=None (positions past 255)",
            gpt2_wte,
            gpt2_wpe,
            long_ids,
            None,
            "positions go up to T-1 = 299: keep them long",
            as_engine=True,
        ),
        _embed_case(
            "GPT-2's tables, decoding at positions 1000 and 700",
            gpt2_wte,
            gpt2_wpe,
            torch.tensor([[50256], [1000]]),
            torch.tensor([[1000], [700]]),
        ),
        _embed_case(
            "as the engine passes them: ids[:, 100:] (a slice) and positions arange(100, 300).expand(2, 200)",
            gpt2_wte,
            gpt2_wpe,
            long_ids[:, 100:],
            torch.arange(100, 300).expand(2, 200),
            NOT_CONTIGUOUS,
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.float32, torch.float64, torch.float16, torch.float32, torch.bfloat16]
    for i in range(n_random):
        v, p, c = _randint(g, 2, 2000), _randint(g, 2, 1100), _randint(g, 1, 32)
        b, t = _randint(g, 1, 4), _randint(g, 1, min(p, 12 if i % 3 else 400))
        dtype = dtypes[i % len(dtypes)]
        wte, wpe = _far_from_zero(g, (v, c), dtype), _far_from_zero(g, (p, c), dtype)
        ids = torch.randint(0, v, (b, t), generator=g)
        if i % 2:
            pos = None
        else:  # each row starts at its own offset (left padding clamps to 0; a cache shifts everything)
            start = torch.randint(-3, p - t + 1, (b, 1), generator=g)
            pos = (start + torch.arange(t)).clamp(min=0)
        what = "position_ids=None" if pos is None else "own position_ids per row"
        cases.append(
            _embed_case(
                f"random #{i} (batch {b}, {t} tokens, C={c}, {what}, {dtype})",
                wte,
                wpe,
                ids,
                pos,
                as_engine=pos is None and i % 4 == 1,
            )
        )
    run_check(
        "embed",
        fn,
        cases,
        judge=tensor_judge(_embed_tolerance, EMBED_MISTAKES),
        forbid=NO_EMBEDDING,
        error_hints=EMBED_ERROR_HINTS,
    )


# ----------------------------------------------------------------------------------------------
# Exercise 3: sinusoidal_positions(n_positions, dim, base=10000.0)


def _sinusoid(
    n_positions: int,
    dim: int,
    base: float,
    exponent: Callable[[Tensor], Tensor],
    first=torch.sin,
    second=torch.cos,
    interleaved: bool = True,
    wrap: int = 0,
) -> Tensor:
    """The encoding with a choice of exponent, order and layout: the right one and the usual mistakes."""
    p = torch.arange(n_positions, dtype=torch.float64)[:, None]  # [P, 1]
    if wrap:
        p = p % wrap
    angle = p / base ** exponent(torch.arange(dim // 2, dtype=torch.float64))  # [P, dim/2]
    if interleaved:
        return torch.stack([first(angle), second(angle)], dim=-1).flatten(1).float()
    return torch.cat([first(angle), second(angle)], dim=-1).float()


def _sin_args(args: tuple) -> tuple[int, int, float]:
    n, dim, *rest = args
    return n, dim, rest[0] if rest else 10000.0


SINUSOIDAL_MISTAKES: list[Mistake] = [
    (
        lambda *a: _sinusoid(*_sin_args(a), lambda i: 2 * i / _sin_args(a)[1], interleaved=False),
        "interleave them as in the paper: sin in the even columns 0, 2, 4, ..., cos in the odd ones (the layout "
        "with all sines first, then all cosines, is RoPE's half-split, not this encoding)",
    ),
    (
        lambda *a: _sinusoid(*_sin_args(a), lambda i: i / _sin_args(a)[1]),
        "the exponent is 2i/dim, where i counts the (sin, cos) pairs: column 2i and 2i+1 share base^(2i/dim)",
    ),
    (
        lambda *a: _sinusoid(*_sin_args(a), lambda i: 2 * i / _sin_args(a)[1], torch.cos, torch.sin),
        "sin goes in the even columns (2i) and cos in the odd ones (2i+1): row 0 is [0, 1, 0, 1, ...]",
    ),
    (
        lambda *a: _sinusoid(*_sin_args(a), lambda i: 2 * i / _sin_args(a)[1]).double(),
        "return float32, whatever you computed in (.float())",
    ),
    (
        lambda *a: _sinusoid(_sin_args(a)[0], _sin_args(a)[1], 10000.0, lambda i: 2 * i / _sin_args(a)[1]),
        "use the base you are given now (the default 10000 is only the default, and a table cached by "
        "(n_positions, dim) alone is an earlier call's)",
    ),
    (
        lambda *a: _sinusoid(*_sin_args(a), lambda i: 2 * i / _sin_args(a)[1], wrap=256),
        "positions go past 255: count them in int64 or float (torch.arange(n) is int64; uint8 wraps at 256)",
    ),
    (
        lambda *a: _sinusoid(*_sin_args(a), lambda i: 2 * i / _sin_args(a)[1], wrap=2048),
        "compute n_positions rows, however many: a table of a fixed size (2048 rows) repeats or runs out",
    ),
]


def _sinusoidal_case(description: str, *args, hint: str = "") -> Case:
    return Case(description, args, later(positions.sinusoidal_positions, *args), hint)


def _sinusoidal_tolerance(case: Case) -> tuple[float, float]:
    # sin(p·w) computed in float32 is off by about p·1e-7: allowed (the paper's encoding is float32)
    return 1e-6 + 3e-7 * case.args[0], 0.0


def check_sinusoidal_positions(fn, *, seed: int = 0, n_random: int = 8) -> None:
    """sinusoidal_positions(n_positions, dim, base=10000.0) -> float32 [n_positions, dim]."""
    cases = [
        _sinusoidal_case(
            "one position, dim 2 (position 0 is [sin 0, cos 0])",
            1,
            2,
            hint="row p is [sin(p·w0), cos(p·w0), sin(p·w1), cos(p·w1), ...]",
        ),
        _sinusoidal_case("4 positions, dim 4", 4, 4),
        _sinusoidal_case(
            "dim 2: one pair, angle = position", 5, 2, hint="with dim 2, column 0 is sin(p), column 1 cos(p)"
        ),
        _sinusoidal_case("8 positions, dim 16", 8, 16),
        _sinusoidal_case("base 100", 6, 8, 100.0, hint="the base is an argument: use it"),
        _sinusoidal_case("base 2", 10, 6, 2.0),
        _sinusoidal_case("GPT-2's size: 1024 positions, dim 768", 1024, 768),
        _sinusoidal_case("no positions: shape [0, dim]", 0, 4),
        _sinusoidal_case("16 positions, dim 8 (the default base)", 16, 8),
        _sinusoidal_case(
            "16 positions, dim 8 again, base 100 (a table kept from the call before is wrong now)",
            16,
            8,
            100.0,
            hint="compute the table for the base you are given now: a cache keyed on "
            "(n_positions, dim) alone returns the previous call's table",
        ),
        _sinusoidal_case("16 positions, dim 8, base 2", 16, 8, 2.0),
        _sinusoidal_case("16 positions, dim 8, the default base once more", 16, 8),
        _sinusoidal_case(
            "300 positions (past 255), dim 4", 300, 4, hint="positions go up to 299: count them in int64 or float"
        ),
        _sinusoidal_case(
            "4096 positions (past 2048), dim 64",
            4096,
            64,
            hint="compute n_positions rows, however many (no table of a fixed size)",
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        n, dim = _randint(g, 1, 2048), 2 * _randint(g, 1, 96)
        if i % 2:
            base = float(torch.tensor([10.0, 1000.0, 10000.0, 1e5, 5e5])[_randint(g, 0, 4)])
            cases.append(_sinusoidal_case(f"random #{i} ({n} positions, dim {dim}, base {base:g})", n, dim, base))
        else:
            cases.append(_sinusoidal_case(f"random #{i} ({n} positions, dim {dim})", n, dim))
    run_check(
        "sinusoidal_positions",
        fn,
        cases,
        judge=tensor_judge(_sinusoidal_tolerance, SINUSOIDAL_MISTAKES),
        forbid=NO_POSITIONS,
        timeout_hint="compute all positions and frequencies at once with tensors "
        "(an outer product), not in a Python loop over every entry",
    )


# ----------------------------------------------------------------------------------------------
# Exercise 4: rope(x, position_ids, base=10000.0)


def _rope_args(args: tuple) -> tuple[Tensor, Tensor, float]:
    x, pos, *rest = args
    return x, pos, rest[0] if rest else 10000.0


def _rope_interleaved(x: Tensor, pos: Tensor, base: float = 10000.0) -> Tensor:
    """GPT-J / the original RoFormer: pairs (2i, 2i+1) — a different layout from Llama's checkpoints."""
    cos, sin = positions.rope_cos_sin(pos, x.shape[-1], base, x.dtype)
    d = x.shape[-1] // 2
    cos, sin = cos[:, None, :, :d], sin[:, None, :, :d]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def _rope_with(
    x: Tensor,
    pos: Tensor,
    base: float,
    *,
    sign: int = 1,
    exponent_step: int = 2,
    angle_dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """Half-split RoPE with a chosen sign of rotate_half, exponent and precision of the angles."""
    d = x.shape[-1]
    dtype = angle_dtype or torch.float64
    inv_freq = 1.0 / base ** (torch.arange(0, d // 2, dtype=dtype) * exponent_step / d)
    angle = pos[..., None].to(dtype) * inv_freq
    angle = torch.cat([angle, angle], dim=-1)[:, None]  # [B, 1, T, D]
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1) * sign
    return x * angle.cos().to(x.dtype) + rotated * angle.sin().to(x.dtype)


def _rope_half_angles(x: Tensor, pos: Tensor, base: float = 10000.0) -> Tensor:
    """The angles computed in x's dtype, float16 or bfloat16 (named only there: float32 angles are allowed)."""
    if x.dtype not in HALF_DTYPES:
        raise ValueError("float32 angles are a mistake of their own, and only for a float64 x")
    return _rope_with(x, pos, base, angle_dtype=x.dtype)


ROPE_MISTAKES: list[Mistake] = [
    (
        lambda *a: _rope_interleaved(*_rope_args(a)),
        "use the half-split layout of Llama/Qwen checkpoints: dimension i is paired with i + D/2 (rotate_half), "
        "not with its neighbour i + 1 (that is GPT-J's interleaved layout)",
    ),
    (
        lambda *a: _rope_with(*_rope_args(a), sign=-1),
        "rotate_half(x) = cat(-x2, x1): the minus goes on the second half; with cat(x2, -x1) every pair turns "
        "the other way",
    ),
    (
        lambda *a: _rope_with(*_rope_args(a), exponent_step=1),
        "the speeds are base^(-2i/D) for i = 0 .. D/2-1, i.e. 1 / base^(arange(0, D, 2) / D) (step 2 over D)",
    ),
    (
        lambda *a: positions.rope(
            _rope_args(a)[0], torch.arange(a[0].shape[-2]).expand(a[0].shape[0], -1), _rope_args(a)[2]
        ),
        "use position_ids: rows of a batch may start at different positions (left padding), and a decoded token "
        "sits at position past_length, not 0",
    ),
    (
        lambda *a: _rope_with(*_rope_args(a), angle_dtype=torch.float32),
        "compute the angles (inv_freq and position × inv_freq) in float64 (or in x's dtype when it is float64): "
        "in float32 an angle of 1000 radians is off by about 3e-5, which a float64 input must not lose. "
        "torch.arange(...) is float32 unless you pass dtype=",
    ),
    (
        lambda *a: _rope_half_angles(*_rope_args(a)),
        "the angles were computed in x's dtype: in float16 and bfloat16, inv_freq keeps 3 digits and a position past "
        "2048 (float16) or 256 (bfloat16) is rounded (3999 is 4000 in bfloat16), so the angles are off by radians. "
        "Compute inv_freq and position × inv_freq in float64 (or float32), then cast cos and sin to x's dtype",
    ),
    (
        lambda *a: positions.rope(_rope_args(a)[0].float(), *_rope_args(a)[1:]),
        "return x's dtype: float64 in, float64 out; float16 / bfloat16 in, the same out (cast cos and sin to x's "
        "dtype, or the result back)",
    ),
    (
        lambda *a: positions.rope(_rope_args(a)[0], _rope_args(a)[1] % 256, _rope_args(a)[2]),
        "positions go past 255: keep position_ids as they are (int64), no uint8",
    ),
    (lambda *a: a[0].clone(), "rotate x: out = x·cos + rotate_half(x)·sin, with the angles of each token's position"),
]


def _rope_case(description: str, x: Tensor, pos: Tensor, *base: float, hint: str = "") -> Case:
    expected = positions.rope(x.double(), pos, *base).to(x.dtype)  # float16 / bfloat16: rounded once
    return Case(description, (x, pos, *base), expected, hint)


def _rope_tolerance(case: Case) -> tuple[float, float]:
    """float32: an answer whose angles are float32 is allowed (transformers computes them so); its
    error grows with the position. float64: only float64 rounding. float16 / bfloat16: computed in x's
    dtype, x·cos + rotate_half(x)·sin is off by a few roundings of |x| (4 eps), plus float32 angles."""
    x, pos = case.args[0], case.args[1]
    big = float(x.abs().max()) if x.numel() else 0.0
    far = float(pos.abs().max()) if pos.numel() else 0.0
    if x.dtype == torch.float64:
        return 1e-10 * (1 + big) * (1 + far / 1000), 0.0
    if x.dtype in HALF_DTYPES:
        return 4 * torch.finfo(x.dtype).eps * (1 + big) + 5e-7 * far * big, 0.0
    return 1e-5 * (1 + big) + 5e-7 * far * big, 0.0


def _as_engine_qk(
    g: torch.Generator, B: int, H: int, T: int, D: int, dtype: torch.dtype = torch.float32, scale: float = 1.0
) -> Tensor:
    """q (or k) as an engine makes it: the projection's [B, T, 3·H·D] output, cut into q, k, v and split into
    heads with view + transpose: a non-contiguous [B, H, T, D] view."""
    qkv = (torch.randn(B, T, 3 * H * D, generator=g, dtype=torch.float64) * scale).to(dtype)
    q = qkv.split(H * D, dim=-1)[1]  # [B, T, H·D], a slice
    return q.view(B, T, H, D).transpose(1, 2)


def check_rope(fn, *, seed: int = 0, n_random: int = 10) -> None:
    """rope(x [B, H, T, D], position_ids [B, T], base=10000.0) -> [B, H, T, D], rotated (half-split layout)."""
    fixed = torch.Generator().manual_seed(1234)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=fixed, dtype=torch.float64).to(dtype)

    unit = torch.zeros(1, 1, 4, 2)
    unit[..., 0] = 1.0
    cases = [
        _rope_case(
            "D = 2: one pair, turned by its position in radians",
            unit,
            torch.tensor([[0, 1, 2, 3]]),
            hint="with D = 2 the single pair (x0, x1) is turned by the angle p (speed base^0 = 1)",
        ),
        _rope_case(
            "position 0 changes nothing", rand(1, 2, 1, 8), torch.tensor([[0]]), hint="angle 0: cos = 1, sin = 0"
        ),
        _rope_case("a small example, D = 8", rand(1, 1, 3, 8), torch.tensor([[0, 1, 2]])),
        _rope_case(
            "batch 2, 3 heads, D = 64, left padding (each row its own positions)",
            rand(2, 3, 5, 64),
            torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]),
            hint="row b uses position_ids[b]; every head of a row uses the same positions",
        ),
        _rope_case("decoding one token at position 1000, D = 128", rand(1, 2, 1, 128), torch.tensor([[1000]])),
        _rope_case(
            "base 500000 (Llama 3), D = 64",
            rand(1, 2, 4, 64),
            torch.tensor([[3, 4, 5, 6]]),
            500000.0,
            hint="the base is an argument: use it",
        ),
        _rope_case(
            "base 1e6 (Qwen2), D = 128, rows at different offsets",
            rand(2, 1, 3, 128),
            torch.tensor([[10, 11, 12], [200, 201, 202]]),
            1e6,
        ),
        _rope_case(
            "float64 stays float64, positions up to 4096",
            rand(2, 2, 3, 16, dtype=torch.float64),
            torch.tensor([[0, 1, 2], [4094, 4095, 4096]]),
            hint="float64 in, float64 out: compute the angles in float64 too",
        ),
        _rope_case(
            "float64 at position 100000 (angles must be float64 too)",
            rand(1, 1, 2, 8, dtype=torch.float64),
            torch.tensor([[100000, 100001]]),
        ),
        _rope_case("values far from 0", 1000 * rand(1, 2, 3, 8) + 500, torch.tensor([[5, 6, 7]])),
        _rope_case(
            "float positions, D = 2 (chapter 11 hands rope each pair of a scaled model as a 2-dimensional vector "
            "whose position is its angle)",
            rand(4, 2, 3, 2),
            torch.tensor(
                [[0.0, 0.5, 1.25], [3.0, 7.75, 100.5], [0.001, 2.0, 3.14159], [1e4, 1e4 + 0.5, 2e4]],
                dtype=torch.float64,
            ),
            hint="positions may be floats (a scaled model's angles): compute the angles from position_ids as "
            "numbers, not as indices into a table, and keep their fractions (no .long())",
        ),
        _rope_case(
            "as an engine calls it: k from split_heads (a transposed, non-contiguous view), positions "
            "arange(300).expand(2, 300)",
            _as_engine_qk(fixed, 2, 3, 300, 16),
            torch.arange(300).expand(2, 300),
            hint=NOT_CONTIGUOUS,
        ),
        _rope_case(
            "the same shapes, decoding one token per row at positions 300 and 1000 (non-contiguous q)",
            _as_engine_qk(fixed, 2, 3, 1, 64),
            torch.tensor([[300], [1000]]),
        ),
        _rope_case(
            "float16 stays float16 (q from split_heads)",
            _as_engine_qk(fixed, 2, 2, 5, 32, torch.float16),
            torch.tensor([[0, 1, 2, 3, 4], [600, 601, 602, 603, 604]]),
            hint="float16 in, float16 out",
        ),
        _rope_case(
            "bfloat16 stays bfloat16, positions up to 4000",
            rand(1, 4, 3, 64, dtype=torch.bfloat16),
            torch.tensor([[3998, 3999, 4000]]),
        ),
        _rope_case("x [1, 2, 3, 16] at positions 0, 1, 2", rand(1, 2, 3, 16), torch.tensor([[0, 1, 2]])),
        _rope_case(
            "the same shapes at positions 5, 6, 7 (nothing may be kept from the call before)",
            rand(1, 2, 3, 16),
            torch.tensor([[5, 6, 7]]),
            hint="compute the angles of the position_ids you are given now: a cache "
            "keyed on the shapes returns the previous call's rotation",
        ),
        _rope_case(
            "the same shapes and positions, base 100",
            rand(1, 2, 3, 16),
            torch.tensor([[5, 6, 7]]),
            100.0,
            hint="the base is an argument: a cos/sin table cached by (T, D) or by D alone must also depend on the base",
        ),
    ]
    g = torch.Generator().manual_seed(seed)
    for i in range(n_random):
        b, h, t = _randint(g, 1, 3), _randint(g, 1, 4), _randint(g, 1, 7)
        d = [2, 4, 6, 8, 32, 64, 80, 96, 128][_randint(g, 0, 8)]
        dtype = [torch.float32, torch.float32, torch.float64, torch.float32, torch.bfloat16, torch.float16][i % 6]
        far = 100000 if dtype == torch.float64 else 3000
        start = torch.randint(0, far, (b, 1), generator=g)
        pos = start + torch.arange(t)  # [B, T]: each row at its own offset
        x = (
            _far_from_zero(g, (b, h, t, d), dtype) if i % 4 else _as_engine_qk(g, b, h, t, d, dtype, _randint(g, 1, 30))
        )  # a view, as split_heads gives
        what = f"batch {b}, {h} heads, {t} tokens, D={d}, {dtype}"
        if i % 2:
            base = float(torch.tensor([10000.0, 500000.0, 1e6, 100.0])[_randint(g, 0, 3)])
            cases.append(_rope_case(f"random #{i} ({what}, base {base:g})", x, pos, base))
        else:
            cases.append(_rope_case(f"random #{i} ({what})", x, pos))
    run_check(
        "rope",
        fn,
        cases,
        judge=tensor_judge(_rope_tolerance, ROPE_MISTAKES),
        forbid=NO_POSITIONS,
        error_hints={"view size is not compatible": NOT_CONTIGUOUS},
    )
