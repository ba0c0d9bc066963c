"""The Llama family: Llama 2 / 3 / 3.x, Mistral, Qwen2 and Qwen3, as one model written from swappable parts.

Each of them is GPT-2 with five changes (chapter 11): RMSNorm instead of LayerNorm, a SwiGLU MLP (three
matrices), rotary positions applied to queries and keys instead of a learned table, grouped-query attention
(n_kv_head ≤ n_head heads of keys and values, each shared by n_head / n_kv_head query heads) and, in Qwen3, an
RMSNorm on every head's query and key. Qwen2 adds biases to q, k and v. Parameter names are transformers'
checkpoint keys without the `model.` prefix, and weights keep `nn.Linear`'s [C_out, C_in] layout, so loading
is a plain copy.

    >>> config = LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, vocab_size=50)
    >>> Llama(config).init_weights()(torch.tensor([[1, 2, 3]])).shape
    torch.Size([1, 3, 50])
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from . import positions
from .config import CheckpointError
from .decoder import Decoder
from .model import Table
from .parts import Parts

FAMILIES = {  # model_type -> the architecture transformers saves it as
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    n_layer: int = 16
    n_head: int = 32
    n_kv_head: int = 8
    n_embd: int = 2048
    intermediate_size: int = 8192
    n_positions: int = 2048
    vocab_size: int = 128256
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"rope_type": "llama3" or "linear", "factor": ..., ...}; None: plain RoPE
    qk_norm: bool = False  # Qwen3
    attention_bias: bool = False  # Qwen2: q, k, v have biases
    tie_word_embeddings: bool = True
    head_dim: Optional[int] = None  # None: n_embd // n_head (Qwen3 sets its own)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: Optional[int] = None
    model_type: str = "llama"

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise CheckpointError(
                f"config: n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): "
                "each KV head serves the same number of query heads"
            )
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise CheckpointError(f"config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if self.head_dim % 2:
            raise CheckpointError(f"config: head_dim ({self.head_dim}) must be even: RoPE turns pairs of dimensions")
        if self.model_type not in FAMILIES:
            raise CheckpointError(f"config: model_type {self.model_type!r} is not one of {', '.join(FAMILIES)}")
        kind = (self.rope_scaling or {}).get("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise CheckpointError(
                f"config: rope scaling {kind!r} is not supported by this engine (it runs {', '.join(ROPE_TYPES)})"
            )
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))

    @property
    def n_rep(self) -> int:
        """Query heads per KV head."""
        return self.n_head // self.n_kv_head

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "LlamaConfig":
        """Read transformers' config.json of a llama / mistral / qwen2 / qwen3 model, refusing what the engine
        does not run (another activation, a sliding window shorter than the context is capped instead)."""
        model_type = raw.get("model_type")
        if model_type not in FAMILIES:
            raise CheckpointError(f"{where}: model_type {model_type!r} is not a Llama-family model")
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported; the family uses 'silu'")
        if raw.get("mlp_bias"):
            raise CheckpointError(f"{where}: mlp_bias=true is not supported by this engine")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})  # transformers 5 / 4 spellings
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        if "type" in rope:
            rope.setdefault("rope_type", rope.pop("type"))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        context = raw.get("max_position_embeddings", 2048)
        window = raw.get("sliding_window")
        if window and (model_type == "mistral" or raw.get("use_sliding_window")):
            context = min(context, window)  # within the window, sliding attention is plain causal attention
        eos = raw.get("eos_token_id")
        try:
            return cls(
                n_layer=raw["num_hidden_layers"],
                n_head=raw["num_attention_heads"],
                n_kv_head=raw.get("num_key_value_heads") or raw["num_attention_heads"],
                n_embd=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                n_positions=context,
                vocab_size=raw["vocab_size"],
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=rope or None,
                qk_norm=model_type == "qwen3",
                attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                tie_word_embeddings=raw.get("tie_word_embeddings", False),
                head_dim=raw.get("head_dim"),
                eos_token_ids=() if eos is None else (eos,) if isinstance(eos, int) else tuple(eos),
                bos_token_id=raw.get("bos_token_id"),
                model_type=model_type,
            )
        except KeyError as err:
            raise CheckpointError(f"{where}: missing {err.args[0]!r}") from None

    def to_dict(self) -> dict:
        """config.json for transformers' `AutoModelForCausalLM.from_pretrained`."""
        eos = list(self.eos_token_ids)
        return {
            "architectures": [FAMILIES[self.model_type]],
            "model_type": self.model_type,
            "hidden_act": "silu",
            "num_hidden_layers": self.n_layer,
            "num_attention_heads": self.n_head,
            "num_key_value_heads": self.n_kv_head,
            "hidden_size": self.n_embd,
            "intermediate_size": self.intermediate_size,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.n_positions,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})},
            "attention_bias": self.attention_bias and self.model_type != "qwen2",
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        }


class Linear(nn.Module):
    """Weights of one projection in `nn.Linear`'s layout: y = x @ weight.T + bias, with the `linear` part.
    A projection without bias adds zeros (a buffer, not saved): the `linear` part always takes one."""

    def __init__(self, n_in: int, n_out: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in))
        if bias:
            self.bias = nn.Parameter(torch.zeros(n_out))
        else:
            self.register_buffer("bias", torch.zeros(n_out), persistent=False)

    def forward(self, x: Tensor, linear: Callable) -> Tensor:
        """x [..., C_in] -> [..., C_out]."""
        return linear(x, self.weight.T, self.bias)


class RMSNorm(nn.Module):
    """Weights of one RMSNorm (a scale, no bias)."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, D, bias = config.n_embd, config.head_dim, config.attention_bias
        self.q_proj = Linear(C, config.n_head * D, bias)
        self.k_proj = Linear(C, config.n_kv_head * D, bias)
        self.v_proj = Linear(C, config.n_kv_head * D, bias)
        self.o_proj = Linear(config.n_head * D, C)
        if config.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(D), RMSNorm(D)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, F = config.n_embd, config.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = Linear(C, F), Linear(C, F), Linear(F, C)


class Layer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd)
        self.mlp = MLP(config)


class Llama(Decoder):
    """A Llama-family language model: token ids [B, T] -> next-token logits [B, T, vocab_size]."""

    token_table = "embed_tokens"  # quantization replaces it (and the head, tied or not)

    def __init__(self, config: LlamaConfig, parts: Optional[Parts] = None):
        super().__init__()
        self.config = config
        self.parts = parts or Parts()
        self.embed_tokens = Table(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.n_embd, config.vocab_size)
        # [D/2] float64: the engine's own rope_frequencies for this config (a learner's is called at every forward)
        self.register_buffer("inv_freq", Parts.rope_frequencies(*self.rope_arguments()), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` leaves the rotary speeds in float64 (angles of long contexts need it)."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def init_weights(self, seed: int = 0) -> "Llama":
        """transformers' initialization: normal with std 0.02, norms 1, biases 0."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        return self

    def embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Token embeddings only: positions enter each attention layer as a rotation."""
        return self.embed_tokens(input_ids, self.parts.embedding, self.dtype)

    def rope_arguments(self) -> tuple:
        """(head_dim, rope_theta, rope_scaling) as the `rope_frequencies` part takes them (the scaling a copy)."""
        cfg = self.config
        return cfg.head_dim, cfg.rope_theta, None if cfg.rope_scaling is None else dict(cfg.rope_scaling)

    def rotation(self, position_ids: Tensor) -> Callable[[Tensor], Tensor]:
        """RoPE for these positions [B, T], as a function of queries or keys [B, heads, T, D], built from the parts
        `rope_frequencies` (each pair's speed, with the config's scaling) and `rope`; neither is ever bypassed.

        The engine's own `rope`: cos and sin of position × speed, computed once for all layers. A learner's `rope`
        with the engine's frequencies and no scaling: `rope(t, position_ids, rope_theta)`, chapter 02's call.
        Otherwise (scaled RoPE, or a learner's `rope_frequencies`) the learner's `rope` turns each pair by its angle:
        pair (i, i + D/2) of t is a 2-dimensional vector in a batch row of its own whose position is its angle,
        position × speed[i] (a 2-dimensional RoPE has the single speed 1 / base**0 = 1, so it turns by exactly
        its position): t [B, H, T, D] -> pairs [D/2 · B, H, T, 2] with float64 positions [D/2 · B, T], one call
        `rope(pairs, angles, rope_theta)`, back to [B, H, T, D]. That `rope` must take float positions.
        """
        p, cfg = self.parts, self.config
        own = p.rope_frequencies is Parts.rope_frequencies
        inv_freq = self.inv_freq if own else p.rope_frequencies(*self.rope_arguments()).to(self.inv_freq.device)
        if p.rope is not Parts.rope and own and (cfg.rope_scaling or {}).get("rope_type", "default") == "default":
            return lambda t: p.rope(t, position_ids, cfg.rope_theta)
        angle = position_ids[..., None].double() * inv_freq  # [B, T, D/2]
        if p.rope is Parts.rope:
            angle = torch.cat([angle, angle], dim=-1)[:, None]  # [B, 1, T, D]: pair i is (i, i + D/2)
            cos, sin = angle.cos().to(self.dtype), angle.sin().to(self.dtype)
            return lambda t: t * cos + positions.rotate_half(t) * sin
        half, (B, T) = angle.shape[-1], position_ids.shape
        angles = angle.permute(2, 0, 1).reshape(half * B, T)  # [D/2 · B, T]: pair i of row b is row i · B + b

        def rotate(t: Tensor) -> Tensor:
            H = t.shape[1]
            pairs = t.reshape(B, H, T, 2, half).permute(4, 0, 1, 2, 3).reshape(half * B, H, T, 2)  # (t_i, t_{i+D/2})
            turned = p.rope(pairs, angles, cfg.rope_theta)  # [D/2 · B, H, T, 2]
            return turned.reshape(half, B, H, T, 2).permute(1, 2, 3, 4, 0).reshape(B, H, T, 2 * half)

        return rotate

    def blocks(self, x: Tensor, position_ids: Tensor, attend: Callable) -> Tensor:
        rope = self.rotation(position_ids)
        for i, layer in enumerate(self.layers):
            x = self.parts.llama_block(x, layer, self.config, rope, lambda q, k, v, i=i: attend(i, q, k, v), self.parts)
        return x

    def head(self, x: Tensor) -> Tensor:
        """Final RMSNorm and the head (the token table when tied): [..., C] -> [..., vocab_size]."""
        x = self.parts.rms_norm(x, self.norm.weight, self.config.rms_norm_eps)
        if self.config.tie_word_embeddings:
            return self.embed_tokens.logits(x)
        return self.lm_head(x, self.parts.linear)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor]) -> Tensor:
        """Grouped-query attention: each of the H_kv cached heads read once for its n_rep query heads
        (`grouped_attention`, with the `attention` part)."""
        p = self.parts
        return p.grouped_attention(q, k, v, mask, p.attention)
