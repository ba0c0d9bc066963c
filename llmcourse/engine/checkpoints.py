"""Reading checkpoint folders as transformers' `save_pretrained` writes them: one `model.safetensors`, or shards
listed by `model.safetensors.index.json` (its `weight_map`: tensor name -> shard file).

    >>> state = read_safetensors("llmcourse/models/gpt2-shakespeare")   # doctest: +SKIP
    >>> state, config = load_llama_checkpoint("path/to/Llama-3.2-1B")   # doctest: +SKIP
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import CheckpointError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: Union[str, Path]) -> list[Path]:
    """The safetensors files of a checkpoint folder: `model.safetensors`, else every shard its index names."""
    folder = Path(folder)
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    if not (folder / INDEX_FILE).is_file():
        raise CheckpointError(
            f"{folder} has no {WEIGHTS_FILE} (nor a sharded {INDEX_FILE}); a model folder needs config.json and "
            "its weights, as transformers' save_pretrained writes them"
        )
    try:
        weight_map = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot read {folder / INDEX_FILE}: {err!r}; re-save or re-download it") from None
    shards = [folder / name for name in dict.fromkeys(weight_map.values())]  # each once, in order
    for shard in shards:
        if not shard.is_file():
            raise CheckpointError(f"{folder / INDEX_FILE} lists {shard.name}, which is missing; re-download it")
    return shards


def read_safetensors(folder: Union[str, Path]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, by its stored name (all shards together)."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as err:
            raise CheckpointError(
                f"cannot read {path}: {err}. The file is corrupt or truncated; re-save or re-download it"
            ) from None
    return state


def read_config(folder: Union[str, Path]) -> dict:
    """config.json of a checkpoint folder, as a dict."""
    path = Path(folder) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return raw


def load_llama_checkpoint(folder: Union[str, Path]) -> tuple[dict[str, torch.Tensor], dict]:
    """A Llama-family checkpoint (Llama, Mistral, Qwen2, Qwen3) -> (its tensors under the engine's names, config.json).

    The engine's names are transformers' without the `model.` prefix (`embed_tokens.weight`,
    `layers.0.self_attn.q_proj.weight`, `norm.weight`); `lm_head.weight` stays only for an untied head
    (`tie_word_embeddings` false), the rotary `inv_freq` buffers old checkpoints carry are dropped (the engine
    computes them). Tensors keep their stored dtype; the model converts them.
    """
    config = read_config(folder)
    state = {}
    for key, tensor in read_safetensors(folder).items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        state[key.removeprefix("model.")] = tensor
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the head is the token table
    return state, config
