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
    """A plugged-in part raised, or returned something the engine cannot use."""


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


def guarded(name: str, fn: Callable) -> Callable:
    """Wrap a plugged-in part so its failures are reported in the engine's terms."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        shapes = ", ".join(str(tuple(a.shape)) if isinstance(a, Tensor) else repr(a) for a in args)
        where = getattr(fn, "__qualname__", repr(fn))
        try:
            out = fn(*args, **kwargs)
        except Exception as err:
            raise PartError(
                f"part '{name}' ({where}) raised {type(err).__name__}: {err}\n"
                f"  called with: {shapes}\n  hint: run the check for '{name}' in its chapter to debug it"
            ) from err
        expected = _expected_shape(name, args)
        if not isinstance(out, Tensor):
            raise PartError(
                f"part '{name}' ({where}) returned {type(out).__name__}, expected a torch.Tensor of "
                f"shape {expected}\n  called with: {shapes}"
            )
        dtype = _float_dtype(args)
        if tuple(out.shape) != expected or out.dtype != dtype:
            raise PartError(
                f"part '{name}' ({where}) returned shape {tuple(out.shape)} dtype {out.dtype}, "
                f"expected shape {expected} dtype {dtype}\n  called with: {shapes}"
            )
        return out

    return call


@dataclasses.dataclass(frozen=True)
class Parts:
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
        names = {f.name for f in dataclasses.fields(cls)}
        for name, fn in overrides.items():
            if name not in names:
                raise ValueError(f"unknown part {name!r}; the parts are: {', '.join(sorted(names))}")
            if not callable(fn):
                raise ValueError(f"part {name!r} must be a function, got {type(fn).__name__}")
        parts = {name: guarded(name, fn) for name, fn in overrides.items()}
        if "attention" in parts:
            parts["attention"] = functools.partial(attention_causal_by_default, attention=parts["attention"])
        elif "softmax" in parts:
            parts["attention"] = functools.partial(attention_with_softmax, softmax=parts["softmax"])
        return cls(**parts)

    def overridden(self) -> list[str]:
        """Names of the parts that are not the engine's own."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not f.default]
