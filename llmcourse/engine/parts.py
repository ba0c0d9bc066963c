"""The named parts GPT-2's forward pass is built from, and the slots learners plug into.

Each part is a plain function on tensors. `Parts()` holds the engine's own; `Parts(gelu=my_gelu)`
swaps one for a function with the same signature. Swapped-in parts are guarded: if one raises or
returns the wrong shape or dtype, the error names the part, the input shapes and what was expected.

    >>> x = torch.tensor([[-1.0, 0.0, 2.0]])
    >>> Parts().gelu(x)
    tensor([[-0.1588,  0.0000,  1.9546]])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor


def embedding(weight: Tensor, ids: Tensor) -> Tensor:
    """Row lookup: weight [N, C], ids [B, T] (long) -> [B, T, C]. Used for tokens and positions."""
    return F.embedding(ids, weight)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """Normalize the last dim to mean 0, variance 1, then scale and shift. x [..., C] -> [..., C]."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def linear(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """x @ weight + bias with GPT-2's weight layout [C_in, C_out]. x [..., C_in] -> [..., C_out]."""
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], weight.shape[-1])


def gelu(x: Tensor) -> Tensor:
    """GPT-2's GELU, the tanh approximation: 0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))."""
    return F.gelu(x, approximate="tanh")


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) along `dim`, computed stably."""
    return torch.softmax(x, dim=dim)


def split_heads(x: Tensor, n_head: int) -> Tensor:
    """[B, T, C] -> [B, n_head, T, C // n_head]."""
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """[B, n_head, T, head_dim] -> [B, T, n_head * head_dim]."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def causal_mask(n_query: int, n_key: int, device=None) -> Tensor:
    """Bool [n_query, n_key], True where query i may see key j: queries are the last n_query keys."""
    query_pos = torch.arange(n_key - n_query, n_key, device=device)
    return torch.arange(n_key, device=device)[None, :] <= query_pos[:, None]


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """Scaled dot-product attention with torch's fused kernel.

    q [B, H, Tq, D], k and v [B, H, Tk, D] -> [B, H, Tq, D]. `mask` is bool, broadcastable to
    [B, H, Tq, Tk], True where attending is allowed; None means causal, with the queries being the
    last Tq positions of the Tk keys (prefill: Tq == Tk; decode: Tq == 1).
    """
    if mask is None:
        if q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.shape[-2] == 1:
            return F.scaled_dot_product_attention(q, k, v)
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_with_softmax(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, *, softmax: Callable = softmax
) -> Tensor:
    """The same attention written out, so that a plugged-in `softmax` part is the one used."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, Tq, Tk]
    if mask is None:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ v


def attention_causal_by_default(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None, *, attention: Callable
) -> Tensor:
    """A plugged-in `attention` reads mask=None as "attend everywhere", like torch's; the model's None
    means causal, so the model's call is given the causal mask explicitly."""
    if mask is None:
        mask = causal_mask(q.shape[-2], k.shape[-2], q.device)
    return attention(q, k, v, mask)


class PartError(RuntimeError):
    """A plugged-in part raised, or returned something the engine cannot use.

    Its message says everything (which part, its input, what was wrong, a hint), so IPython shows just the
    message (`_render_traceback_`), not the engine's frames between the learner's cell and the part.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"PartError: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


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
    return tuple(args[0].shape)  # layer_norm, gelu, softmax keep their input's shape


def _float_dtype(args: tuple) -> torch.dtype:
    return next(a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point())


def _expected_output(name: str, args: tuple) -> tuple[tuple, torch.dtype]:
    return _expected_shape(name, args), _float_dtype(args)


def _describe(args: tuple) -> str:
    return ", ".join(str(tuple(a.shape)) if isinstance(a, Tensor) else repr(a) for a in args)


def guarded(name: str, fn: Callable, expect: Callable[[str, tuple], tuple] = _expected_output,
            validate: Optional[Callable[[str, tuple, Tensor], Optional[str]]] = None) -> Callable:
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
                f"part '{name}' ({where}) raised {type(err).__name__}: {err}\n"
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
            raise PartError(f"part '{name}' ({where}) {problem}\n  called with: {_describe(args)}\n"
                            f"  hint: run the check for '{name}' in its chapter to debug it")
        return out

    return call


def part_failed(name: str, fn: Callable, problem: str, chapter: str, cause: Optional[Exception] = None):
    """Raise the `PartError` for a learner's function `fn` in slot `name` that did something the engine cannot use."""
    where = getattr(fn, "__qualname__", repr(fn))
    raise PartError(f"part '{name}' ({where}) {problem}\n  hint: run the check for '{name}' in chapter {chapter} "
                    "to debug it") from cause


def raising_part(fn: Callable, name: str, chapter: str) -> Callable:
    """A learner's function whose exceptions are reported as the part's (its results are checked where used)."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PartError:
            raise
        except Exception as err:
            part_failed(name, fn, f"raised {type(err).__name__}: {err}", chapter, err)

    return call


class Slots:
    """Swappable functions, the fields of a frozen dataclass whose defaults are the engine's own
    (`Parts` here, `llmcourse.engine.sampling.Sampler`)."""

    @classmethod
    def check_overrides(cls, overrides: dict) -> None:
        """Refuse names that are not slots and values that are not functions (or classes)."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name, fn in overrides.items():
            if name not in names:
                raise ValueError(f"unknown part {name!r}; the parts are: {', '.join(sorted(names))}")
            if not callable(fn):
                raise ValueError(f"part {name!r} must be a function, got {type(fn).__name__}")

    @classmethod
    def guarded_overrides(cls, overrides: dict, expect: Callable[[str, tuple], tuple] = _expected_output,
                          validate: Optional[Callable[[str, tuple, Tensor], Optional[str]]] = None) -> dict:
        """`overrides`, each `guarded` (see `check_overrides` for what is refused)."""
        cls.check_overrides(overrides)
        return {name: guarded(name, fn, expect, validate) for name, fn in overrides.items()}

    def overridden(self) -> list[str]:
        """Names of the slots that do not hold the engine's own function."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not f.default]


@dataclasses.dataclass(frozen=True)
class Parts(Slots):
    """The functions the model calls. Override any by keyword; see each function's docstring.

    The fused `attention` computes its own softmax; when `softmax` is swapped in but `attention`
    is not, the engine switches to the written-out attention so that the swapped-in softmax runs.
    A swapped-in `attention(q, k, v, mask=None)` takes None to mean no mask, like
    `F.scaled_dot_product_attention`: the model always gives it the (causal) mask.
    """

    embedding: Callable = embedding
    layer_norm: Callable = layer_norm
    linear: Callable = linear
    gelu: Callable = gelu
    softmax: Callable = softmax
    attention: Callable = attention
    split_heads: Callable = split_heads
    merge_heads: Callable = merge_heads

    @classmethod
    def with_overrides(cls, **overrides: Callable) -> "Parts":
        """The engine's parts with some replaced, each guarded.

            >>> Parts.with_overrides(gelu=lambda x: x * torch.sigmoid(1.702 * x)).gelu.__name__
            '<lambda>'
        """
        parts = cls.guarded_overrides(overrides)
        if "attention" in parts:
            parts["attention"] = functools.partial(attention_causal_by_default, attention=parts["attention"])
        elif "softmax" in parts:
            parts["attention"] = functools.partial(attention_with_softmax, softmax=parts["softmax"])
        return cls(**parts)


class GuardedCache:
    """A learner's KV cache class in the engine, checked at every step: what `update` returns, and
    that it writes in place (the per-layer tensors are never reallocated).

    The learner's class has the engine's interface: `Cache(config, batch_size, max_len, *, device,
    dtype)` with lists `k`, `v` of [B, n_head, max_len, head_dim] tensors, `length`, and
    `update(layer, k, v)`; `GuardedCache.of(Cache)` is what `model.cache_class` then holds.
    """

    def __init__(self, cls: type, config, batch_size: int, max_len: int, *, device=None, dtype=torch.float32):
        self.where = getattr(cls, "__qualname__", repr(cls))
        self.shape = (batch_size, config.n_head, max_len, config.head_dim)
        self.cache = self._call("__init__", cls, config, batch_size, max_len, device=device, dtype=dtype)
        for name in ("k", "v"):
            tensors = getattr(self.cache, name, None)
            if not isinstance(tensors, list) or len(tensors) != config.n_layer or any(
                    not isinstance(t, Tensor) or tuple(t.shape) != self.shape or t.dtype != dtype for t in tensors):
                self._fail("__init__", f"cache.{name} must be a list of {config.n_layer} tensors (one per layer) "
                                       f"of shape {self.shape} and dtype {dtype}")
        self._remember_addresses()

    @classmethod
    def of(cls, learner_class: type) -> Callable:
        """A factory with the engine's KVCache signature that guards `learner_class`."""
        return functools.partial(cls, learner_class)

    def _call(self, method: str, fn: Callable, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            self._fail(method, f"raised {type(err).__name__}: {err}", err)

    def _fail(self, method: str, problem: str, cause: Optional[Exception] = None):
        raise PartError(f"part 'KVCache' ({self.where}.{method}) {problem}\n"
                        "  hint: run the check for 'KVCache' in chapter 06 to debug it") from cause

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
        if not (isinstance(out, tuple) and len(out) == 2 and all(
                isinstance(t, Tensor) and tuple(t.shape) == expected for t in out)):
            got = [tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__ for t in out] \
                if isinstance(out, tuple) else type(out).__name__
            self._fail("update", f"returned {got}, expected (keys, values), each of shape {expected}: "
                                 f"the {end} positions filled so far")
        if [t.data_ptr() for t in self.cache.k + self.cache.v] != self.addresses:
            self._fail("update", "reallocated the cache: write the new keys and values into the preallocated "
                                 "tensors in place (cache.k[layer][:, :, start:end] = k)")
        return out

    def reorder(self, rows: Tensor) -> None:
        """Keep batch rows `rows` (beam search), as the engine's KVCache does."""
        self.cache.k = [t.index_select(0, rows) for t in self.cache.k]
        self.cache.v = [t.index_select(0, rows) for t in self.cache.v]
        self.shape = (len(rows), *self.shape[1:])
        self._remember_addresses()
