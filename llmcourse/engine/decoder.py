"""What every model family shares: the KV cache, and a decoder-only forward pass over it.

A family (`model.GPT2`, `llama.Llama`) is a `Decoder` that says how to `embed` token ids, run its `blocks` and
its `head`, and how its `attention` reads the cached keys and values; `Decoder.forward` does the rest the same
way for all of them: positions, the padding mask, the cache (contiguous here, paged in `serving.paged_cache`,
which calls the same three methods), the static-shape step compiled decoding replays.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from . import cpu_kernels


class KVCache:
    """Keys and values of every layer, preallocated for `max_len` positions.

    Prefill writes the prompt's keys/values at positions [0, T); each decode step writes one more.
    Nothing is reallocated while generating; `reorder` follows beams in beam search. Each layer
    has its own tensors (not slices of one), so a compiled step can write them in place.

        >>> from llmcourse.engine.config import GPT2Config
        >>> cache = KVCache(GPT2Config(n_layer=1, n_head=2, n_embd=8), batch_size=1, max_len=4)
        >>> cache.k[0].shape   # layer 0: [B, n_kv_head, max_len, head_dim]
        torch.Size([1, 2, 4, 4])
    """

    def __init__(self, config, batch_size: int, max_len: int, *, device=None, dtype=torch.float32):
        shape = (batch_size, config.n_kv_head, max_len, config.head_dim)  # GQA: only the KV heads are stored
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.length = 0  # positions filled so far
        if self.k[0].is_cuda:
            for t in self.k + self.v:  # fixed addresses: a CUDA graph may write into them in place
                torch._dynamo.mark_static_address(t)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def update(self, layer: int, k: Tensor, v: Tensor, slot: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Store k, v [B, H_kv, T, D]; return the keys and values to attend to.

        Without `slot`: after the filled positions, returning the filled part (its length grows).
        With `slot` (a long tensor [T] of positions): there, returning the whole cache, so that
        every step sees tensors of the same shape (what torch.compile and CUDA graphs need).
        """
        k_cache, v_cache = self.k[layer], self.v[layer]  # [B, H_kv, max_len, D]
        if slot is not None:
            k_cache[:, :, slot] = k
            v_cache[:, :, slot] = v
            return k_cache, v_cache
        end = self.length + k.shape[2]
        k_cache[:, :, self.length : end] = k
        v_cache[:, :, self.length : end] = v
        return k_cache[:, :, :end], v_cache[:, :, :end]

    def reorder(self, rows: Tensor) -> None:
        """Keep batch rows `rows` (beam search: each surviving beam copies its parent's cache)."""
        self.k = [t.index_select(0, rows) for t in self.k]
        self.v = [t.index_select(0, rows) for t in self.v]


class Decoder(nn.Module):
    """A decoder-only language model: token ids [B, T] -> next-token logits [B, T, vocab_size]. Subclasses set
    `config` (with n_layer, n_kv_head, head_dim, n_positions, vocab_size, eos_token_ids) and `parts`, and
    define `device`, `dtype`, `embed`, `blocks`, `head` and `attention`."""

    config: object
    parts: object

    def new_cache(self, batch_size: int, max_len: Optional[int] = None, *, cache_class: Optional[Callable] = None):
        """An empty cache for this model: a `KVCache`, or of `cache_class` (same constructor)."""
        cls = cache_class or KVCache
        return cls(self.config, batch_size, max_len or self.config.n_positions, device=self.device, dtype=self.dtype)

    def forward(
        self,
        input_ids: Tensor,
        *,
        position_ids: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        slot: Optional[Tensor] = None,
        last_only: bool = False,
    ) -> Tensor:
        """Logits for each position of `input_ids` [B, T] -> [B, T, vocab_size] (T=1 if `last_only`).

        With a `cache`, `input_ids` continue the cached positions, and their keys/values are added.
        `attention_mask` [B, past + T] marks real tokens (1) and padding (0); `position_ids` [B, T]
        default to past, past+1, ....

        `slot` (a long tensor [1]) is the static-shape variant used by compiled decoding: the
        tokens go to cache positions slot, slot+1, ... and attend to the whole cache through
        `attention_mask` [B, cache.max_len] (0 for positions not yet written). `cache.length` is
        then the caller's to advance; no shape or Python number changes from step to step.
        """
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        if slot is not None:
            if cache is None or attention_mask is None or attention_mask.shape[1] != cache.max_len:
                raise ValueError("slot needs a cache and an attention_mask over all cache.max_len positions")
            past = slot
        query_pos = past + torch.arange(T, device=input_ids.device)  # [T]
        if position_ids is None:
            position_ids = query_pos.expand(B, T)
        mask = None  # None = plain causal attention, the fused kernel's fast path
        if attention_mask is not None:
            key_pos = torch.arange(attention_mask.shape[1], device=input_ids.device)
            # A padding query sees only itself, so its row is never empty (no NaN) and never read.
            mask = ((key_pos <= query_pos[:, None]) & attention_mask[:, None, None, :].bool()) | (
                key_pos == query_pos[:, None]
            )  # [B, 1, T, keys]
        slots = query_pos if slot is not None else None

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # q [B, H, T, D], k, v [B, H_kv, T, D]
            if cache is not None:
                # a learner's cache (chapter 06) has update(layer, k, v): only a compiled step passes slots
                k, v = cache.update(layer, k, v) if slots is None else cache.update(layer, k, v, slots)
            return self.attention(q, k, v, mask)

        with cpu_kernels.computing():
            x = self.blocks(self.embed(input_ids, position_ids), position_ids, attend)
            if cache is not None and slot is None:
                cache.length += T
            if last_only:
                x = x[:, -1:]
            return self.head(x)

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Token ids [B, T] -> hidden states [B, T, C]."""
        raise NotImplementedError

    def blocks(self, x: Tensor, position_ids: Tensor, attend: Callable) -> Tensor:
        """The transformer blocks, x [B, T, C] -> [B, T, C]. `attend(layer, q, k, v)` (q [B, H, T, D], k and v
        [B, H_kv, T, D]) -> [B, H, T, D] stores the keys and values and attends: the only thing that differs
        between caches."""
        raise NotImplementedError

    def head(self, x: Tensor) -> Tensor:
        """Final norm and output head: [..., C] -> [..., vocab_size]."""
        raise NotImplementedError

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """Attention of q [B, H, Tq, D] over the cached k, v [B, H_kv, Tk, D] -> [B, H, Tq, D]; `mask` as the
        `attention` part takes it."""
        raise NotImplementedError
