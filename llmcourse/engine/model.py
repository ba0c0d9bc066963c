"""GPT-2, written as a composition of swappable parts, with a static KV cache.

Parameter names are GPT-2's checkpoint keys (`wte`, `h.0.attn.c_attn`, `ln_f`, ...), and linear
weights keep the checkpoint's [C_in, C_out] layout, so loading is a plain copy. The forward pass calls
the functions of `model.parts` (`Parts`); each layer computes with them, or, once quantized
(`quantize.quantize_model`), with its own kernel: the model never asks which.

    >>> model = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=8, n_positions=16, vocab_size=10))
    >>> model(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 10])
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

from .config import GPT2Config
from .parts import Parts


class Affine(nn.Module):
    """Weights of one GPT-2 linear layer (HF's `Conv1D`): y = x @ weight + bias, with the `linear` part."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: Tensor, linear: Callable) -> Tensor:
        """x [..., C_in] -> [..., C_out]."""
        return linear(x, self.weight, self.bias)


class Norm(nn.Module):
    """Weights of one layer norm."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))


class Table(nn.Module):
    """An embedding table [N, C]. `column_major` stores it as [C, N] in memory (`weight` is then a transposed
    view): the token table doubles as the tied head, `x @ weight.T`, and on a CPU that product is up to
    2× faster for 4–8 rows (a speculative verify pass) when weight.T is contiguous; a lookup of a few
    columns costs as little as one of a few rows."""

    def __init__(self, n: int, dim: int, column_major: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, n).T if column_major else torch.empty(n, dim))

    def forward(self, ids: Tensor, embedding: Callable, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Rows of the table, with the `embedding` part: ids [B, T] -> [B, T, C]."""
        return embedding(self.weight, ids)

    def logits(self, x: Tensor) -> Tensor:
        """The tied head, x @ weight.T: [..., C] -> [..., N]."""
        return x @ self.weight.T


class Attention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_attn = Affine(config.n_embd, 3 * config.n_embd)
        self.c_proj = Affine(config.n_embd, config.n_embd)


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Affine(config.n_embd, 4 * config.n_embd)
        self.c_proj = Affine(4 * config.n_embd, config.n_embd)


class Block(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.ln_1 = Norm(config.n_embd)
        self.attn = Attention(config)
        self.ln_2 = Norm(config.n_embd)
        self.mlp = MLP(config)


class KVCache:
    """Keys and values of every layer, preallocated for `max_len` positions.

    Prefill writes the prompt's keys/values at positions [0, T); each decode step writes one more.
    Nothing is reallocated while generating; `reorder` follows beams in beam search. Each layer
    has its own tensors (not slices of one), so a compiled step can write them in place.

        >>> cache = KVCache(GPT2Config(n_layer=1, n_head=2, n_embd=8), batch_size=1, max_len=4)
        >>> cache.k[0].shape   # layer 0: [B, n_head, max_len, head_dim]
        torch.Size([1, 2, 4, 4])
    """

    def __init__(self, config: GPT2Config, batch_size: int, max_len: int, *, device=None, dtype=torch.float32):
        shape = (batch_size, config.n_head, max_len, config.head_dim)
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
        """Store k, v [B, H, T, D]; return the keys and values to attend to.

        Without `slot`: after the filled positions, returning the filled part (its length grows).
        With `slot` (a long tensor [T] of positions): there, returning the whole cache, so that
        every step sees tensors of the same shape (what torch.compile and CUDA graphs need).
        """
        k_cache, v_cache = self.k[layer], self.v[layer]  # [B, H, max_len, D]
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


class GPT2(nn.Module):
    """GPT-2's language model: token ids [B, T] -> next-token logits [B, T, vocab_size]."""

    def __init__(self, config: GPT2Config, parts: Optional[Parts] = None):
        super().__init__()
        self.config = config
        self.parts = parts or Parts()  # the functions the forward pass calls
        self.wte = Table(config.vocab_size, config.n_embd, column_major=True)
        self.wpe = Table(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = Norm(config.n_embd)

    @property
    def device(self) -> torch.device:
        return self.ln_f.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.ln_f.weight.dtype

    def init_weights(self, seed: int = 0) -> "GPT2":
        """GPT-2's initialization (normal, std 0.02; residual projections scaled by 1/√(2·n_layer))."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln_" in name or name.startswith("ln_f"):
                    p.fill_(1.0)
                else:
                    std = 0.02 / (2 * self.config.n_layer) ** 0.5 if name.endswith("c_proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=g) * std)
        return self

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

        def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # [B, H, T, D] each -> [B, H, T, D]
            if cache is not None:
                # a learner's cache (chapter 06) has update(layer, k, v): only a compiled step passes slots
                k, v = cache.update(layer, k, v) if slots is None else cache.update(layer, k, v, slots)
            return self.parts.attention(q, k, v, mask)

        x = self.blocks(self.embed(input_ids, position_ids), attend)
        if cache is not None and slot is None:
            cache.length += T
        if last_only:
            x = x[:, -1:]
        return self.head(x)

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Token plus position embeddings: ids [B, T] -> [B, T, C]."""
        p = self.parts
        return self.wte(input_ids, p.embedding, self.dtype) + self.wpe(position_ids, p.embedding)

    def blocks(self, x: Tensor, attend) -> Tensor:
        """The transformer blocks, x [B, T, C] -> [B, T, C]. `attend(layer, q, k, v)` [B, H, T, D] -> [B, H, T, D]
        is the only thing that differs between caches (a contiguous one here, a paged one in `paged_cache`)."""
        p, cfg = self.parts, self.config
        for i, block in enumerate(self.h):
            a = p.layer_norm(x, block.ln_1.weight, block.ln_1.bias, cfg.layer_norm_epsilon)
            qkv = block.attn.c_attn(a, p.linear)  # [B, T, 3C]
            q, k, v = (p.split_heads(t, cfg.n_head) for t in qkv.split(cfg.n_embd, dim=-1))  # [B, H, T, D]
            a = p.merge_heads(attend(i, q, k, v))  # [B, T, C]
            x = x + block.attn.c_proj(a, p.linear)
            m = p.layer_norm(x, block.ln_2.weight, block.ln_2.bias, cfg.layer_norm_epsilon)
            m = p.gelu(block.mlp.c_fc(m, p.linear))  # [B, T, 4C]
            x = x + block.mlp.c_proj(m, p.linear)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Final layer norm and the head, tied to the token embedding: [..., C] -> [..., vocab_size]."""
        x = self.parts.layer_norm(x, self.ln_f.weight, self.ln_f.bias, self.config.layer_norm_epsilon)
        return self.wte.logits(x)
