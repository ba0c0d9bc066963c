"""Guards: a learner's function in the engine, checked at every call, its failures reported in the engine's terms.

Every replaceable function of the engine (the slots of `Parts`, `Sampler`, `Speculation`, `Quantization`,
`Batching`, and the KV cache class and `left_pad` of generation) has a guard here, keyed by the slot's name.
`guarded(Table, **functions)` is the one way a learner's functions enter the engine: each is wrapped with its
guard once, and the table the driver takes is returned. A guarded function that raises, or returns the wrong
shape, dtype or range, stops the run with a `PartError` naming the slot, its input and what was expected.

    >>> parts = guarded(Parts, gelu=lambda x: x * torch.sigmoid(1.702 * x))
    >>> parts.overridden()
    ['gelu']
    >>> guarded(Parts, gelu=lambda x: x[0]).gelu(torch.zeros(2, 3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    llmcourse.engine.slots.PartError: part 'gelu' (<lambda>) returned shape (3,) ..., expected shape (2, 3) ...
      called with: (2, 3)
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Callable, Optional

import torch
from torch import Tensor

from llmcourse.engine.parts import Parts, attention_causal_by_default, attention_with_softmax
from llmcourse.engine.quantize import GROUP_SIZE, Quantization, dequantize_int4, quantize_int4
from llmcourse.engine.roofline import Cost, Roofline, RooflineTime, StepTime
from llmcourse.engine.sampling import PROCESSORS, Sampler
from llmcourse.engine.slots import PartError, Slots, raised
from llmcourse.engine.speculative import Speculation, verify
from llmcourse.engine.structured.regex import compile_regex

# -- shared: reporting a failure, checking a result's shape ------------------------------------------------


def _expected_shape(name: str, args: tuple) -> tuple:
    """The shape each part must return, from its inputs."""
    if name == "embedding":
        weight, ids = args[:2]
        return (*ids.shape, weight.shape[-1])
    if name == "linear":
        x, weight = args[:2]
        return (*x.shape[:-1], weight.shape[-1])
    if name == "split_heads":
        (B, T, C), n_head = args[0].shape, args[1]
        return (B, n_head, T, C // n_head)
    if name == "merge_heads":
        B, H, T, D = args[0].shape
        return (B, T, H * D)
    if name == "attention":
        q, v = args[0], args[2]
        return (*q.shape[:-1], v.shape[-1])
    return tuple(args[0].shape)  # layer_norm, gelu, softmax, rms_norm, swiglu, rope, llama_block keep x's shape


def _float_dtype(args: tuple) -> torch.dtype:
    return next(a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point())


def _expected_output(name: str, args: tuple) -> tuple[tuple, torch.dtype]:
    return _expected_shape(name, args), _float_dtype(args)


def _describe(args: tuple) -> str:
    return ", ".join(str(tuple(a.shape)) if isinstance(a, Tensor) else repr(a) for a in args)


def guard_result(
    name: str,
    fn: Callable,
    expect: Callable[[str, tuple], tuple] = _expected_output,
    validate: Optional[Callable[[str, tuple, Tensor], Optional[str]]] = None,
) -> Callable:
    """Wrap a plugged-in function so its failures are reported in the engine's terms.

    `expect(name, args)` gives the (shape, dtype) it must return; a long result must hold token ids
    (in [0, V) for logits [..., V]). `validate(name, args, out)`, if given, says what else the result breaks
    (None: nothing), so the part that first broke the contract is named, not a later one that chokes on it.
    """

    @functools.wraps(fn)
    def call(*args, **kwargs):
        where = getattr(fn, "__qualname__", repr(fn))
        try:
            out = fn(*args, **kwargs)
        except Exception as err:
            raise PartError(
                f"part '{name}' ({where}) {raised(err)}\n"
                f"  called with: {_describe(args)}\n  hint: run the check for '{name}' in its chapter to debug it"
            ) from err
        shape, dtype = expect(name, args)
        if not isinstance(out, Tensor):
            raise PartError(
                f"part '{name}' ({where}) returned {type(out).__name__}, expected a torch.Tensor of "
                f"shape {shape}\n  called with: {_describe(args)}"
            )
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise PartError(
                f"part '{name}' ({where}) returned shape {tuple(out.shape)} dtype {out.dtype}, "
                f"expected shape {shape} dtype {dtype}\n  called with: {_describe(args)}"
            )
        if dtype == torch.long and out.numel() and not (0 <= int(out.min()) and int(out.max()) < args[0].shape[-1]):
            raise PartError(
                f"part '{name}' ({where}) returned token ids {out.tolist()}, expected ids in "
                f"[0, {args[0].shape[-1]})\n  called with: {_describe(args)}"
            )
        problem = validate(name, args, out) if validate is not None else None
        if problem:
            raise PartError(
                f"part '{name}' ({where}) {problem}\n  called with: {_describe(args)}\n"
                f"  hint: run the check for '{name}' in its chapter to debug it"
            )
        return out

    return call


def part_failed(name: str, fn: Callable, problem: str, chapter: str, cause: Optional[Exception] = None):
    """Raise the `PartError` for a learner's function `fn` in slot `name` that did something the engine cannot use."""
    where = getattr(fn, "__qualname__", repr(fn))
    raise PartError(
        f"part '{name}' ({where}) {problem}\n  hint: run the check for '{name}' in chapter {chapter} to debug it"
    ) from cause


def raising_part(fn: Callable, name: str, chapter: str) -> Callable:
    """A learner's function whose exceptions are reported as the part's (its results are checked where used)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PartError:
            raise
        except Exception as err:
            part_failed(name, fn, raised(err), chapter, err)

    return call


# -- the forward pass (chapters 02-04, 11) and the KV cache (chapter 06) -------------------------------------


def guarded_loader(fn: Callable) -> Callable:
    """A learner's `load_llama_checkpoint` (chapter 11): a pair (state dict of tensors by name, config as a dict);
    the engine's `check_weights` then names a missing, unexpected or misshapen tensor."""
    call = raising_part(fn, "load_llama_checkpoint", "11")

    @functools.wraps(fn)
    def checked(folder, *args, **kwargs):
        out = call(folder, *args, **kwargs)
        if not (isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[0], dict)):
            part_failed(
                "load_llama_checkpoint",
                fn,
                f"returned {type(out).__name__}; expected a pair (state_dict, config): the tensors by the engine's "
                "names and config.json as a dict",
                "11",
            )
        state, config = out
        wrong = next((k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, Tensor)), None)
        if wrong is not None:
            part_failed(
                "load_llama_checkpoint",
                fn,
                f"returned a state dict whose entry {wrong!r:.80} is {type(state[wrong]).__name__}; expected a tensor "
                "under each name",
                "11",
            )
        if not isinstance(config, dict):
            part_failed(
                "load_llama_checkpoint",
                fn,
                f"returned a config of type {type(config).__name__}; expected config.json read as a dict",
                "11",
            )
        return dict(state), dict(config)

    return checked


def guarded_qk_norm(fn: Callable) -> Callable:
    """A learner's `qk_norm` (chapter 11): a pair (q, k) of q's and k's shapes and dtypes, each checked."""
    call = raising_part(fn, "qk_norm", "11")

    @functools.wraps(fn)
    def checked(q: Tensor, k: Tensor, *args, **kwargs):
        out = call(q, k, *args, **kwargs)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            part_failed("qk_norm", fn, f"returned {type(out).__name__}; expected a pair (q, k) of tensors", "11")
        for what, got, want in (("q", out[0], q), ("k", out[1], k)):
            if not isinstance(got, Tensor) or got.shape != want.shape or got.dtype != want.dtype:
                shown = f"shape {tuple(got.shape)} dtype {got.dtype}" if isinstance(got, Tensor) else type(got).__name__
                part_failed(
                    "qk_norm",
                    fn,
                    f"returned {what} as {shown}; expected shape {tuple(want.shape)} dtype {want.dtype}\n"
                    f"  called with: {_describe((q, k, *args))}",
                    "11",
                )
        return out[0], out[1]

    return checked


FLOAT_POSITIONS = (
    "chapter 11 calls rope with angles as float positions: with scaled RoPE (a config's rope_scaling) or your "
    "rope_frequencies, each pair (i, i + D/2) of the queries and keys is a 2-dimensional vector whose position is "
    "its angle, position × frequency[i], a float64 (a 2-dimensional RoPE turns by exactly its position). Your rope "
    "must accept float position_ids: compute the angles as position_ids[..., None].double() * inv_freq, without "
    "casting the positions to integers or indexing a table with them"
)


def guarded_rope(fn: Callable) -> Callable:
    """A learner's `rope` (chapter 02): x's shape and dtype, as every part's; a failure on float positions (how
    chapter 11's `Llama.rotation` composes it with `rope_frequencies`) says why it was called so."""
    call = guard_result("rope", fn)

    @functools.wraps(fn)
    def checked(x, position_ids, *args, **kwargs):
        try:
            return call(x, position_ids, *args, **kwargs)
        except PartError as err:
            if not (isinstance(position_ids, Tensor) and position_ids.is_floating_point()):
                raise
            raise PartError(f"{err}\n  note: {FLOAT_POSITIONS}") from err.__cause__

    return checked


def guarded_grouped_attention(fn: Callable) -> Callable:
    """A learner's `grouped_attention` (chapter 11): one output per query head and position, [B, H, T, Dv] in q's
    dtype."""
    call = raising_part(fn, "grouped_attention", "11")

    @functools.wraps(fn)
    def checked(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], attention: Callable, *args, **kwargs):
        out = call(q, k, v, mask, attention, *args, **kwargs)
        shape = (*q.shape[:-1], v.shape[-1])
        if not isinstance(out, Tensor) or tuple(out.shape) != shape or out.dtype != q.dtype:
            shown = f"shape {tuple(out.shape)} dtype {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            part_failed(
                "grouped_attention",
                fn,
                f"returned {shown}, expected shape {shape} dtype {q.dtype}: one output per query head (H = "
                f"{q.shape[1]}, not the {k.shape[1]} KV heads) and position, back in q's layout [B, H, T, D]\n"
                f"  called with: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, mask "
                f"{None if mask is None else tuple(mask.shape)}",
                "11",
            )
        return out

    return checked


def guarded_rope_frequencies(fn: Callable) -> Callable:
    """A learner's `rope_frequencies` (chapter 11): float64 [head_dim / 2], finite and positive. It is given a copy
    of the config's scaling (a function that changes it changes no config)."""
    call = raising_part(fn, "rope_frequencies", "11")

    @functools.wraps(fn)
    def checked(head_dim: int, rope_theta: float, rope_scaling: Optional[dict], *args, **kwargs):
        scaling = None if rope_scaling is None else dict(rope_scaling)
        out = call(head_dim, rope_theta, scaling, *args, **kwargs)
        shape, called = (head_dim // 2,), f"head_dim={head_dim}, rope_theta={rope_theta!r}, rope_scaling={rope_scaling}"
        if not isinstance(out, Tensor) or tuple(out.shape) != shape or out.dtype != torch.float64:
            shown = f"shape {tuple(out.shape)} dtype {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            part_failed(
                "rope_frequencies",
                fn,
                f"returned {shown}, expected shape {shape} dtype torch.float64: one angular speed per rotated pair, "
                f"in float64 (a long context's angles, position × speed, need it)\n  called with: {called}",
                "11",
            )
        if not bool((torch.isfinite(out) & (out > 0)).all()):
            part_failed(
                "rope_frequencies",
                fn,
                f"returned speeds that are not all finite and positive: {out.tolist()!s:.120}\n  called with: {called}",
                "11",
            )
        return out

    return checked


class GuardedCache:
    """A learner's KV cache class in the engine, checked at every step: what `update` returns, and
    that it writes in place (the per-layer tensors are never reallocated).

    The learner's class has the engine's interface: `Cache(config, batch_size, max_len, *, device,
    dtype)` with lists `k`, `v` of [B, n_kv_head, max_len, head_dim] tensors, `length`, and
    `update(layer, k, v)`; `GuardedCache.of(Cache)` (`guard("KVCache", Cache)`) is what generation's `kv_cache=` takes.
    """

    def __init__(self, cls: type, config, batch_size: int, max_len: int, *, device=None, dtype=torch.float32):
        self.where = getattr(cls, "__qualname__", repr(cls))
        n_kv_head = getattr(config, "n_kv_head", config.n_head)  # GQA: only the KV heads are cached
        self.shape = (batch_size, n_kv_head, max_len, config.head_dim)
        self.cache = self._call("__init__", cls, config, batch_size, max_len, device=device, dtype=dtype)
        for name in ("k", "v"):
            tensors = getattr(self.cache, name, None)
            if (
                not isinstance(tensors, list)
                or len(tensors) != config.n_layer
                or any(not isinstance(t, Tensor) or tuple(t.shape) != self.shape or t.dtype != dtype for t in tensors)
            ):
                self._fail(
                    "__init__",
                    f"cache.{name} must be a list of {config.n_layer} tensors (one per layer) "
                    f"of shape {self.shape} and dtype {dtype}",
                )
        self._remember_addresses()

    @classmethod
    def of(cls, learner_class: type) -> Callable:
        """A factory with the engine's KVCache signature that guards `learner_class`."""
        return functools.partial(cls, learner_class)

    def _call(self, method: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            self._fail(method, raised(err), err)

    def _fail(self, method: str, problem: str, cause: Optional[Exception] = None):
        raise PartError(
            f"part 'KVCache' ({self.where}.{method}) {problem}\n"
            "  hint: run the check for 'KVCache' in chapter 06 to debug it"
        ) from cause

    def _remember_addresses(self) -> None:
        self.addresses = [t.data_ptr() for t in self.cache.k + self.cache.v]

    @property
    def length(self) -> int:
        return self.cache.length

    @length.setter
    def length(self, value: int) -> None:
        self.cache.length = value

    @property
    def max_len(self) -> int:
        return self.shape[2]

    def update(self, layer: int, k: Tensor, v: Tensor, slot: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        if slot is not None:
            raise PartError("a compiled decode step writes the cache at a slot, which only the engine's KVCache does")
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise PartError(f"the cache holds {self.max_len} positions; {end} were asked for")
        out = self._call("update", self.cache.update, layer, k, v)
        expected = (*self.shape[:2], end, self.shape[3])
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and all(isinstance(t, Tensor) and tuple(t.shape) == expected for t in out)
        ):
            got = (
                [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in out]
                if isinstance(out, tuple)
                else type(out).__name__
            )
            self._fail(
                "update",
                f"returned {got}, expected (keys, values), each of shape {expected}: the {end} positions filled so far",
            )
        if [t.data_ptr() for t in self.cache.k + self.cache.v] != self.addresses:
            self._fail(
                "update",
                "reallocated the cache: write the new keys and values into the preallocated "
                "tensors in place (cache.k[layer][:, :, start:end] = k)",
            )
        return out

    def reorder(self, rows: Tensor) -> None:
        """Keep batch rows `rows` (beam search), as the engine's KVCache does."""
        self.cache.k = [t.index_select(0, rows) for t in self.cache.k]
        self.cache.v = [t.index_select(0, rows) for t in self.cache.v]
        self.shape = (len(rows), *self.shape[1:])
        self._remember_addresses()


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def _roofline_time(out) -> Optional[RooflineTime]:
    """A kernel's (seconds, "memory" or "compute", intensity, ridge) as the engine's `RooflineTime`, or None. The
    intensity of a kernel of no bytes is infinite."""
    ok = isinstance(out, (tuple, list)) and len(out) == 4 and out[1] in ("memory", "compute")
    ok = ok and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (out[0], out[2], out[3]))
    return RooflineTime(float(out[0]), out[1], float(out[2]), float(out[3])) if ok else None


def _roofline_output(name: str, out, args: tuple = ()) -> tuple[object, str]:
    """(the output as the engine's own returns it, or None; what was expected) for a roofline slot called with
    `args`."""

    def numbers_of(n: int) -> Optional[tuple]:
        ok = isinstance(out, (tuple, list)) and len(out) == n and all(_real(x) for x in out)
        return tuple(float(x) for x in out) if ok else None

    if name == "decode_step":
        return numbers_of(2), "(flops, bytes), two numbers >= 0"
    if name == "utilization":
        return numbers_of(2), "(mbu, mfu), two numbers >= 0"
    if name in ("gemm_cost", "attention_cost"):
        got = numbers_of(2)
        return (Cost(*got) if got else None), "(flops, bytes), two numbers >= 0"
    if name == "roofline_time":
        return _roofline_time(out), '(seconds, "memory" or "compute", intensity, ridge)'
    if name == "step_time":
        count = len(args[0]) if args and isinstance(args[0], (tuple, list)) else None
        each = f"one for each of the {count} kernels" if count is not None else "one for each kernel"
        expected = f'(seconds, [(seconds, "memory" or "compute", intensity, ridge), ...]): a number >= 0 and {each}'
        ok = isinstance(out, (tuple, list)) and len(out) == 2 and _real(out[0])
        ok = ok and isinstance(out[1], (tuple, list)) and (count is None or len(out[1]) == count)
        times = [_roofline_time(t) for t in out[1]] if ok else [None]
        return (StepTime(float(out[0]), times) if None not in times else None), expected
    if name == "gpu_roof":
        ok = isinstance(out, (tuple, list)) and len(out) == 2 and _real(out[1]) and (out[0] is None or _real(out[0]))
        return ((None if out[0] is None else float(out[0]), float(out[1])) if ok else None), (
            "(peak FLOP/s, bandwidth in bytes/s), numbers > 0"
        )
    if name == "critical_batch":
        if out is None:
            return None, ""  # no batch is compute-bound: None is the answer itself
        ok = _real(out) and out >= 1 and out == int(out)
        return (int(out) if ok else None), "a whole batch size >= 1, or None"
    ok = _real(out) and out == int(out)  # max_sequences, matrix_bytes
    return (int(out) if ok else None), "a whole number >= 0"


def guarded_roofline(name: str, fn: Callable) -> Callable:
    """A learner's roofline formula (chapter 06's `decode_step`, `max_sequences`; chapter 10's others): its output
    checked and returned as the engine's own returns it (`Cost`, `RooflineTime`, `StepTime`, plain numbers)."""
    chapter = "06" if name in ("decode_step", "max_sequences") else "10"
    call = raising_part(fn, name, chapter)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        out = call(*args, **kwargs)
        if name == "critical_batch" and out is None:
            return None
        got, expected = _roofline_output(name, out, args)
        if got is None:
            part_failed(name, fn, f"returned {out!r:.80}; expected {expected}", chapter)
        return got

    return checked


# -- choosing tokens (chapter 05) ---------------------------------------------------------------------------


def _sampler_output(name: str, args: tuple) -> tuple[tuple, torch.dtype]:
    """The shape and dtype each sampler function must return: ids [B] for a choice, else logits' own."""
    logits = args[0]
    if name in ("greedy", "sample"):
        return tuple(logits.shape[:-1]), torch.long
    return tuple(logits.shape), logits.dtype


def _processor_contract(name: str, args: tuple, out: Tensor) -> Optional[str]:
    """What a processor's logits break, or None: every row whose input could be sampled from (a finite logit, no
    NaN) must stay so — a NaN, or a row with every token removed, would only fail later, inside `sample`."""
    if name not in PROCESSORS:
        return None
    logits = args[0]
    usable = torch.isfinite(logits).any(dim=-1) & ~torch.isnan(logits).any(dim=-1)  # [B]
    nan = torch.isnan(out).any(dim=-1) & usable
    if bool(nan.any()):
        row = int(nan.nonzero()[0])
        return (
            f"returned NaN in row {row} (of {out.shape[0]}); a processor returns logits, with -inf for the "
            "tokens it removes"
        )
    empty = ~torch.isfinite(out).any(dim=-1) & usable
    if bool(empty.any()):
        row = int(empty.nonzero()[0])
        return (
            f"removed every token of row {row} (of {out.shape[0]}): no finite logit is left, so no token can be "
            "chosen; it must keep at least the most likely token"
        )
    return None


# -- batching (chapter 07) ----------------------------------------------------------------------------------


def _fail07(name: str, fn: Callable, problem: str, cause: Exception = None):
    part_failed(name, fn, problem, "07", cause)


def _raising07(fn: Callable, name: str) -> Callable:
    return raising_part(fn, name, "07")


def guarded_left_pad(fn: Callable) -> Callable:
    call = _raising07(fn, "left_pad")

    @functools.wraps(fn)
    def checked(prompts: list[list[int]], *args):
        out = call(prompts, *args)
        shape = (len(prompts), max(map(len, prompts)))
        if not (
            isinstance(out, tuple)
            and len(out) == 3
            and all(isinstance(t, Tensor) and tuple(t.shape) == shape and t.dtype == torch.long for t in out)
        ):
            _fail07(
                "left_pad",
                fn,
                f"returned {out!r:.200}; expected (input_ids, attention_mask, position_ids), "
                f"each a long tensor of shape {shape}",
            )
        return out

    return checked


def guarded_block_hashes(fn: Callable) -> Callable:
    """A learner's `block_hashes`: one integer per full block (that a request's first hashes never change as its
    tokens grow is checked by the block manager)."""
    call = _raising07(fn, "block_hashes")

    @functools.wraps(fn)
    def checked(token_ids: list[int], block_size: int) -> list[int]:
        out = call(token_ids, block_size)
        n = len(token_ids) // block_size
        ok = isinstance(out, (list, tuple)) and len(out) == n
        if not ok or any(isinstance(h, bool) or not isinstance(h, numbers.Integral) for h in out):
            _fail07(
                "block_hashes",
                fn,
                f"returned {out!r:.200}; expected a list of {n} integers, one per full block of {block_size} "
                f"tokens (a partial last block has no hash)\n  called with: {len(token_ids)} token ids, "
                f"block_size={block_size}",
            )
        return [int(h) for h in out]  # any integer type (numpy's too)

    return checked


def guarded_attention_parts(name: str, fn: Callable, chapter: str, shapes: Callable[[tuple], tuple]) -> Callable:
    """A learner's attention that returns (out, lse), like `merge_attention` (chapter 03) and `paged_attention`
    (chapter 07): `shapes(args)` gives the shapes of out and lse; both must have the inputs' float dtype."""
    call = raising_part(fn, name, chapter)

    @functools.wraps(fn)
    def checked(*args):
        out = call(*args)
        want, dtype = shapes(args), _float_dtype(args)
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and all(isinstance(t, Tensor) and tuple(t.shape) == s and t.dtype == dtype for t, s in zip(out, want))
        ):
            got = tuple(
                f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
                for t in (out if isinstance(out, tuple) else (out,))
            )
            part_failed(
                name,
                fn,
                f"returned {got}; expected (out, lse) of shapes {want[0]} and {want[1]}, dtype {dtype}\n"
                f"  called with: {_describe(args)}",
                chapter,
            )
        return out

    return checked


def _merged_shapes(args: tuple) -> tuple:
    out1, lse1 = args[:2]  # merge_attention(out1, lse1, out2, lse2)
    return tuple(out1.shape), tuple(lse1.shape)


def _paged_shapes(args: tuple) -> tuple:
    q = args[0]  # paged_attention(q [G, H, D], k_pool, v_pool, block_table, lengths)
    return tuple(q.shape), tuple(q.shape[:-1])


def guarded_allocator(cls: Callable) -> Callable:
    """A learner's `BlockAllocator` class; its methods' exceptions name the part, `allocate`'s ids are checked."""

    class Guarded:
        def __init__(self, num_blocks: int):
            self.num_blocks = num_blocks
            self.inner = _raising07(cls, "BlockAllocator")(num_blocks)
            self.users = [0] * num_blocks  # what the engine asked for, to catch a block handed out twice

        @property
        def num_free(self) -> int:
            n = _raising07(lambda: self.inner.num_free, "BlockAllocator")()
            if n != self.users.count(0):
                _fail07("BlockAllocator", cls, f"num_free is {n!r}, but {self.users.count(0)} blocks are not in use")
            return n

        @property
        def ref_count(self) -> list[int]:
            return self.users

        def allocate(self) -> int:
            block = _raising07(self.inner.allocate, "BlockAllocator")()
            if isinstance(block, bool) or not isinstance(block, numbers.Integral) or not 0 <= block < self.num_blocks:
                _fail07(
                    "BlockAllocator", cls, f"allocate() returned {block!r}, not a block id in [0, {self.num_blocks})"
                )
            block = int(block)  # any integer type (numpy's too): the block tables hold Python ints
            if self.users[block]:
                _fail07(
                    "BlockAllocator",
                    cls,
                    f"allocate() returned block {block}, which is in use "
                    f"({self.users[block]} user(s)): it would be handed out twice",
                )
            self.users[block] = 1
            return block

        def share(self, block: int) -> None:
            _raising07(self.inner.share, "BlockAllocator")(block)
            self.users[block] += 1

        def release(self, block: int) -> None:
            _raising07(self.inner.release, "BlockAllocator")(block)
            self.users[block] -= 1

    return Guarded


# -- speculative decoding (chapter 08) ----------------------------------------------------------------------


def _fail08(name: str, fn: Callable, problem: str, cause: Optional[Exception] = None):
    part_failed(name, fn, problem, "08", cause)


def _calling(name: str, fn: Callable, *args):
    return raising_part(fn, name, "08")(*args)


def _is_id(x, vocab_size: int) -> bool:
    """A token id of any integer type (numpy's too), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and 0 <= x < vocab_size


def outside_p(fn: Callable, name: str, p: Tensor, token: int) -> None:
    """Every token the rule keeps or draws has p > 0: accepted ones with probability min(1, p/q), the
    residual max(0, p - q) and the bonus lie inside p's support. (Greedy: p is one-hot, so this is exact.)"""
    if not p[token] > 0:
        _fail08(
            name,
            fn,
            f"returned token {token}, which the target's distribution p gives probability 0: an accepted "
            f"proposal needs p > 0, and a correction or bonus token is drawn from max(0, p - q) or p",
        )


def guarded_accept_token(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(p, q, draft_token, generator=None):
        out = _calling("accept_token", fn, p, q, draft_token, generator)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Tensor) and out[1].numel() == 1:
            out = (out[0], int(out[1]))
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and isinstance(out[0], (bool, Tensor))
            and _is_id(out[1], p.shape[-1])
        ):
            _fail08(
                "accept_token", fn, f"returned {out!r:.120}; expected (accepted: bool, token id in [0, {p.shape[-1]}))"
            )
        accepted, token = bool(out[0]), int(out[1])
        if accepted and token != draft_token:
            _fail08("accept_token", fn, f"accepted the proposal {draft_token} but returned token {token}")
        outside_p(fn, "accept_token", p, token)
        return accepted, token

    return call


def guarded_verify(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(p, q, draft_tokens, generator=None):
        out = _calling("verify", fn, p, q, draft_tokens, generator)
        if not (
            isinstance(out, tuple)
            and len(out) == 2
            and isinstance(out[0], numbers.Integral)
            and not isinstance(out[0], bool)
            and 0 <= out[0] <= len(draft_tokens)
            and _is_id(out[1], p.shape[-1])
        ):
            _fail08(
                "verify",
                fn,
                f"returned {out!r:.120}; expected (number accepted in [0, {len(draft_tokens)}], "
                f"next token id in [0, {p.shape[-1]}))",
            )
        out = (int(out[0]), int(out[1]))
        for i, token in enumerate([*draft_tokens[: out[0]], out[1]]):
            outside_p(fn, "verify", p[i], token)
        return out

    return call


def guarded_lookup(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(tokens, num_draft_tokens, *args):
        out = _calling("prompt_lookup_draft", fn, list(tokens), num_draft_tokens, *args)
        if not (
            isinstance(out, list)
            and len(out) <= num_draft_tokens
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in out)
            and set(out) <= set(tokens)
        ):
            _fail08(
                "prompt_lookup_draft",
                fn,
                f"returned {out!r:.120}; expected a list of at most {num_draft_tokens} token ids copied from the text",
            )
        return [int(t) for t in out]

    return call


def guarded_best_k(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(alpha, c, max_k):
        out = _calling("best_k", fn, alpha, c, max_k)
        if isinstance(out, Tensor) and out.numel() == 1 and not out.is_floating_point():
            out = int(out)
        if not (isinstance(out, numbers.Integral) and not isinstance(out, bool) and 1 <= out <= max_k):
            _fail08("best_k", fn, f"returned {out!r:.80}; expected an integer k in 1..{max_k}")
        return int(out)

    return call


def guarded_round(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def call(target, draft, target_cache, draft_cache, tokens, num_draft_tokens):
        out = _calling(
            "speculative_round", fn, target, draft, target_cache, draft_cache, list(tokens), num_draft_tokens
        )
        V = target.config.vocab_size
        if not (isinstance(out, list) and 1 <= len(out) <= num_draft_tokens + 1 and all(_is_id(t, V) for t in out)):
            _fail08(
                "speculative_round",
                fn,
                f"returned {out!r:.120}; expected a list of 1 to {num_draft_tokens + 1} "
                f"token ids: the accepted proposals and the target's next token",
            )
        kept = len(tokens) + len(out) - 1
        if target_cache.length != kept or draft_cache.length > kept:
            _fail08(
                "speculative_round",
                fn,
                f"left target_cache.length = {target_cache.length} and draft_cache.length "
                f"= {draft_cache.length}; with {len(tokens)} tokens before the round and "
                f"{len(out)} new, the target's cache must hold exactly {kept} positions "
                f"(all but the last token) and the draft's at most {kept}: roll them back",
            )
        return [int(t) for t in out]

    return call


# -- quantization (chapter 09) ------------------------------------------------------------------------------


def _tensor_problem(got, shape: tuple, dtypes: tuple, what: str) -> Optional[str]:
    if not isinstance(got, Tensor):
        return f"returned {type(got).__name__} for {what}; expected a tensor"
    if tuple(got.shape) != tuple(shape):
        return f"returned {what} of shape {tuple(got.shape)}; expected {tuple(shape)}"
    if got.dtype not in dtypes:
        return f"returned {what} of dtype {got.dtype}; expected {' or '.join(str(d) for d in dtypes)}"
    return None


def _pair_problem(got, shapes: tuple, dtypes: tuple, names: tuple) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"returned {type(got).__name__}; expected a pair ({', '.join(names)})"
    return next((p for p in map(_tensor_problem, got, shapes, dtypes, names) if p), None)


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _validate(name: str, args: tuple, out) -> Optional[str]:
    """What is wrong with a learner's `name(*args)` returning `out`, or None."""
    if name == "quantize_int8":
        (w,) = args[:1]
        problem = _pair_problem(out, (w.shape, w.shape[:1]), ((torch.int8,), FLOATS), ("q", "scale"))
        if problem is None and out[0].numel() and out[0].min() < -127:
            problem = f"returned q with the value {int(out[0].min())}; int8 absmax values lie in [-127, 127]"
        return problem
    if name == "quantize_int4":
        w, group = args[0], args[1] if len(args) > 1 else GROUP_SIZE
        N, K = w.shape
        return _pair_problem(out, ((N, K // 2), (N, K // group)), ((torch.uint8,), FLOATS), ("packed", "scales"))
    if name in ("dequantize_int8", "dequantize_int4"):
        shape = args[0].shape if name == "dequantize_int8" else (args[0].shape[0], 2 * args[0].shape[1])
        return _tensor_problem(out, shape, FLOATS, "the weights")
    if name == "pack_int4":
        return _tensor_problem(out, (*args[0].shape[:-1], args[0].shape[-1] // 2), (torch.uint8,), "the packed bytes")
    if name == "unpack_int4":
        problem = _tensor_problem(out, (*args[0].shape[:-1], 2 * args[0].shape[-1]), (torch.int8,), "the values")
        if problem is None and out.numel() and (out.min() < -8 or out.max() > 7):
            problem = f"returned values from {int(out.min())} to {int(out.max())}; signed 4-bit values lie in [-8, 7]"
        return problem
    if name == "int8_linear":
        x, q = args[0], args[1]
        return _tensor_problem(out, (*x.shape[:-1], q.shape[0]), (x.dtype,), "y")
    if name == "smooth_scales":
        problem = _tensor_problem(out, args[0].shape[:1], FLOATS, "the factors")
        if problem is None and not bool((torch.isfinite(out) & (out > 0)).all()):
            problem = "returned factors that are 0, negative, inf or nan; the input is divided by them"
        return problem
    return None


def guard_quantization(name: str, fn: Callable) -> Callable:
    """A learner's chapter 09 function whose errors and wrong results are reported as the part's."""
    call = raising_part(fn, name, "09")

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        out = call(*args, **kwargs)
        problem = _validate(name, args, out)
        if problem:
            part_failed(name, fn, problem, "09")
        return out

    return checked


# -- the one way in: a table of a learner's functions, each guarded once ------------------------------------


# -- chapter 13: structured output ----------------------------------------------------------------------------


def _fail13(name: str, fn: Callable, problem: str) -> None:
    part_failed(name, fn, problem, "13")


def _is_state(x, num_states: int, dead: bool) -> bool:
    """An automaton state of any integer type (not a bool): 0..num_states-1, or -1 where `dead` is allowed."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and (-1 if dead else 0) <= x < num_states


def guarded_walk_token(fn: Callable) -> Callable:
    """A learner's `walk_token`: a state of the automaton, or -1."""

    @functools.wraps(fn)
    def call(transitions, state, token):
        out = raising_part(fn, "walk_token", "13")(transitions, state, token)
        if not _is_state(out, len(transitions), dead=True):
            _fail13("walk_token", fn, f"returned {out!r:.80} for token {token!r:.40} from state {state}; expected a "
                    f"state of the automaton (0..{len(transitions) - 1}) or -1")  # fmt: skip
        return int(out)

    return call


def guarded_token_index(fn: Callable) -> Callable:
    """A learner's `token_index`: a dict {token id of the vocabulary: a state of the automaton}."""

    @functools.wraps(fn)
    def call(transitions, state, vocab, walk_token):
        out = raising_part(fn, "token_index", "13")(transitions, state, vocab, walk_token)
        if not isinstance(out, dict):
            _fail13("token_index", fn, f"returned {type(out).__name__}; expected a dict {{token id: next state}}")
        for token, target in out.items():
            if token not in vocab or not _is_state(target, len(transitions), dead=False):
                _fail13("token_index", fn, f"returned {{{token!r:.30}: {target!r:.30}, ...}} for state {state}; "
                        "expected token ids of the vocabulary, each with the state it leads to")  # fmt: skip
        return out

    return call


def guarded_mask_logits(fn: Callable) -> Callable:
    """A learner's `mask_logits`: logits' shape and dtype; the allowed tokens (the EOS ids too where accepting) as
    they were, every other token at -inf."""

    @functools.wraps(fn)
    def call(logits, allowed, accepting, eos_ids):
        out = raising_part(fn, "mask_logits", "13")(logits, allowed, accepting, eos_ids)
        if not isinstance(out, Tensor) or out.shape != logits.shape or out.dtype != logits.dtype:
            got = f"shape {tuple(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            _fail13("mask_logits", fn, f"returned {got}; expected logits' shape {tuple(logits.shape)} and dtype "
                    f"{logits.dtype}")  # fmt: skip
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        keep[list(allowed)] = True
        if accepting:
            keep[list(eos_ids)] = True
        if not (torch.equal(out[..., keep], logits[..., keep]) and bool(torch.isneginf(out[..., ~keep]).all())):
            what = f"{len(allowed)} tokens allowed, accepting={accepting}, eos_ids={tuple(eos_ids)}"
            _fail13("mask_logits", fn, f"returned logits that are not the input's where a token is allowed and -inf "
                    f"elsewhere ({what})")  # fmt: skip
        return out

    return call


def guarded_schema_regex(fn: Callable) -> Callable:
    """A learner's `schema_regex`: a string the engine's regex compiler takes (its RegexError says why not)."""

    @functools.wraps(fn)
    def call(schema):
        out = raising_part(fn, "schema_regex", "13")(schema)
        if not isinstance(out, str):
            _fail13("schema_regex", fn, f"returned {type(out).__name__}; expected the regex as a str")
        try:
            compile_regex(out)
        except ValueError as err:
            _fail13("schema_regex", fn, f"returned {out!r:.120}, which the engine cannot compile: {err}")
        return out

    return call


def _result(
    expect: Callable[[str, tuple], tuple] = _expected_output,
    validate: Optional[Callable[[str, tuple, Tensor], Optional[str]]] = None,
) -> Callable:
    return lambda name, fn: guard_result(name, fn, expect, validate)


# slot name -> guard(name, fn) -> the guarded function (slot names are unique across the engine's tables)
GUARDS: dict[str, Callable[[str, Callable], Callable]] = {
    **{name: _result() for name in Parts.slot_names()},
    "qk_norm": lambda name, fn: guarded_qk_norm(fn),
    "rope": lambda name, fn: guarded_rope(fn),
    "grouped_attention": lambda name, fn: guarded_grouped_attention(fn),
    "rope_frequencies": lambda name, fn: guarded_rope_frequencies(fn),
    "load_llama_checkpoint": lambda name, fn: guarded_loader(fn),
    **{name: _result(_sampler_output, _processor_contract) for name in Sampler.slot_names()},
    "KVCache": lambda name, cls: GuardedCache.of(cls),
    **{name: guarded_roofline for name in Roofline.slot_names()},
    "left_pad": lambda name, fn: guarded_left_pad(fn),
    "BlockAllocator": lambda name, cls: guarded_allocator(cls),
    "block_hashes": lambda name, fn: guarded_block_hashes(fn),
    "paged_attention": lambda name, fn: guarded_attention_parts(name, fn, "07", _paged_shapes),
    "merge_attention": lambda name, fn: guarded_attention_parts(name, fn, "03", _merged_shapes),
    "schedule": lambda name, fn: _raising07(fn, name),
    "accept_token": lambda name, fn: guarded_accept_token(fn),
    "verify": lambda name, fn: guarded_verify(fn),
    "prompt_lookup_draft": lambda name, fn: guarded_lookup(fn),
    "best_k": lambda name, fn: guarded_best_k(fn),
    "speculative_round": lambda name, fn: guarded_round(fn),
    **{name: guard_quantization for name in Quantization.slot_names()},
    "walk_token": lambda name, fn: guarded_walk_token(fn),
    "token_index": lambda name, fn: guarded_token_index(fn),
    "mask_logits": lambda name, fn: guarded_mask_logits(fn),
    "schema_regex": lambda name, fn: guarded_schema_regex(fn),
}


def guard(name: str, fn: Callable) -> Callable:
    """A learner's function (or class) for slot `name`, wrapped with that slot's guard."""
    if name not in GUARDS:
        raise ValueError(f"unknown part {name!r}; the parts are: {', '.join(sorted(GUARDS))}")
    if not callable(fn):
        raise ValueError(f"part {name!r} must be a function, got {type(fn).__name__}")
    return GUARDS[name](name, fn)


def composed(table: type, functions: dict) -> dict:
    """Where the engine's own function of a table calls one the learner replaced, that composite uses the
    learner's: a softmax alone runs in the written-out attention, an accept_token alone in the engine's
    verify, pack_int4 / unpack_int4 alone in the engine's quantize_int4 / dequantize_int4. A replaced
    `attention` takes None to mean no mask, like torch's: the model's None (causal) is made explicit."""
    out = dict(functions)
    if table is Parts and "attention" in out:
        out["attention"] = functools.partial(attention_causal_by_default, attention=out["attention"])
    elif table is Parts and "softmax" in out:
        out["attention"] = functools.partial(attention_with_softmax, softmax=out["softmax"])
    if table is Speculation and "accept_token" in out and "verify" not in out:
        out["verify"] = functools.partial(verify, accept_token=out["accept_token"])
    if table is Quantization and "pack_int4" in out and "quantize_int4" not in out:
        out["quantize_int4"] = functools.partial(quantize_int4, pack=out["pack_int4"])
    if table is Quantization and "unpack_int4" in out and "dequantize_int4" not in out:
        out["dequantize_int4"] = functools.partial(dequantize_int4, unpack=out["unpack_int4"])
    return out


def guarded(table: type, **functions: Callable) -> Slots:
    """The engine's `table` (Parts, Sampler, Batching, Speculation, Quantization, Structuring) with a learner's
    functions in it,
    each guarded: what the table's driver takes (`model.parts = guarded(Parts, gelu=my_gelu)`,
    `generate(..., sampler=guarded(Sampler, top_p=my_top_p))`)."""
    table.check_functions(functions)
    return table().replace(**composed(table, {name: guard(name, fn) for name, fn in functions.items()}))
