"""GPT-2, written as a composition of swappable parts, with a static KV cache.

Parameter names are GPT-2's checkpoint keys (`wte`, `h.0.attn.c_attn`, `ln_f`, ...), and linear
weights keep the checkpoint's [C_in, C_out] shape, so loading is a plain copy (in memory they lie transposed,
`Affine`). The forward pass calls
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

from . import cpu_kernels
from .config import GPT2Config
from .decoder import Decoder, KVCache
from .parts import Parts

__all__ = ["GPT2", "GPT2Config", "KVCache"]  # KVCache: where chapter 06 and older code import it from


class Affine(nn.Module):
    """Weights of one GPT-2 linear layer (HF's `Conv1D`): y = x @ weight + bias, with the `linear` part.

    `weight` is [C_in, C_out] as in the checkpoint, stored as its transpose ([C_out, C_in] in memory, as
    `nn.Linear` stores it; `weight` is a transposed view): a decode step's product then reads each output's
    weights side by side, in memory order, and splits between threads into pieces that each read one stretch
    of memory (`cpu_kernels.linear`: 1.9x faster on two threads than the checkpoint's layout, benchmarks.md)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in).T)
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
    """An embedding table [N, C]; the token table doubles as the tied head, `x @ weight.T`, which reads each
    token's row side by side (`cpu_kernels.linear`)."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, dim))

    def forward(self, ids: Tensor, embedding: Callable, dtype: Optional[torch.dtype] = None) -> Tensor:
        """Rows of the table, with the `embedding` part: ids [B, T] -> [B, T, C]."""
        return embedding(self.weight, ids)

    def logits(self, x: Tensor) -> Tensor:
        """The tied head, x @ weight.T: [..., C] -> [..., N]."""
        return cpu_kernels.linear(x.reshape(-1, x.shape[-1]), self.weight.T).view(*x.shape[:-1], self.weight.shape[0])


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


class GPT2(Decoder):
    """GPT-2's language model: token ids [B, T] -> next-token logits [B, T, vocab_size]."""

    token_table = "wte"  # the embedding that is also the head (quantization replaces it)

    def __init__(self, config: GPT2Config, parts: Optional[Parts] = None):
        super().__init__()
        self.config = config
        self.parts = parts or Parts()  # the functions the forward pass calls
        self.wte = Table(config.vocab_size, config.n_embd)
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

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Token plus position embeddings: ids [B, T] -> [B, T, C]."""
        p = self.parts
        return self.wte(input_ids, p.embedding, self.dtype) + self.wpe(position_ids, p.embedding)

    def blocks(self, x: Tensor, position_ids: Tensor, attend) -> Tensor:
        """The transformer blocks, x [B, T, C] -> [B, T, C] (positions are already in x: `embed` added them)."""
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

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """Every head has its own keys and values: the `attention` part as it is."""
        return self.parts.attention(q, k, v, mask)
