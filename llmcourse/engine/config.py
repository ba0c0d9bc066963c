"""GPT-2's hyperparameters, read from and written to Hugging Face's `config.json`.

>>> GPT2Config.small().n_embd
768
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path


class CheckpointError(ValueError):
    """A model folder, config or weights file that cannot be loaded as GPT-2."""


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    n_positions: int = 1024
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise CheckpointError(f"config: n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:
        """Heads of keys and values: GPT-2 gives every query head its own."""
        return self.n_head

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Where generation stops by default: <|endoftext|>."""
        return (50256,)

    @classmethod
    def small(cls) -> "GPT2Config":
        """The real GPT-2 124M configuration."""
        return cls()

    @classmethod
    def from_json(cls, path: Path) -> "GPT2Config":
        """Read a transformers GPT-2 `config.json`, refusing features this engine does not run."""
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise CheckpointError(f"cannot read {path}: {err}") from None
        if raw.get("model_type", "gpt2") != "gpt2":
            raise CheckpointError(
                f"{path}: model_type is {raw['model_type']!r}; this engine runs GPT-2 ('gpt2') and the Llama "
                "family ('llama', 'mistral', 'qwen2', 'qwen3')"
            )
        activation = raw.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{path}: activation_function {activation!r} is not supported; GPT-2 uses 'gelu_new'")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if raw.get(flag):
                raise CheckpointError(f"{path}: {flag}=true is not supported by this engine")
        if raw.get("scale_attn_weights") is False:
            raise CheckpointError(f"{path}: scale_attn_weights=false is not supported by this engine")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: raw[k] for k in fields if k in raw}
        if "n_positions" not in values and "n_ctx" in raw:
            values["n_positions"] = raw["n_ctx"]
        return cls(**values)

    def to_json(self, path: Path) -> None:
        """Write a `config.json` that transformers' `GPT2LMHeadModel.from_pretrained` reads."""
        raw = {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            **dataclasses.asdict(self),
            "n_ctx": self.n_positions,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "tie_word_embeddings": True,
        }
        Path(path).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
