"""Load and save checkpoints in the format transformers' `save_pretrained` writes: GPT-2 and the Llama family.

A model folder holds `config.json` and `model.safetensors` (or shards listed by
`model.safetensors.index.json`); config.json's `model_type` picks the family: 'gpt2' (`model.GPT2`), or
'llama', 'mistral', 'qwen2', 'qwen3' (`llama.Llama`, read by the `load_llama_checkpoint` part). GPT-2 keys
may carry the `transformer.` prefix or not; `lm_head.weight`, when stored, must equal the tied `wte.weight`;
the causal-mask buffers old checkpoints carry (`h.N.attn.bias`, `h.N.attn.masked_bias`) are ignored. Anything
else missing, extra or mis-shaped is refused with an error naming the tensor. A Llama-family folder's
`generation_config.json`, when there, says which ids end a reply (Llama 3 has several).

    >>> model = load_model()                             # the bundled gpt2-shakespeare
    >>> model = load_model("path/to/folder")            # doctest: +SKIP
    >>> model = load_model("gpt2", device="cuda")        # doctest: +SKIP
    >>> model = load_model(quantize="int8")              # weights in 8 bits (see `llmcourse.engine.quantize`)

A quantized model saves to the same two files, its config.json saying which format its tensors
(`qweight`, `scales`) are in; loading it gives the quantized model back without re-quantizing.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors.torch import save_file

from . import quantize as quantization
from . import threads
from .checkpoints import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, read_config, read_safetensors, weight_files
from .config import CheckpointError, GPT2Config
from .decoder import Decoder
from .llama import FAMILIES, Llama, LlamaConfig
from .model import GPT2
from .parts import Parts

GENERATION_FILE = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
MODELS_DIR = Path(__file__).parents[1] / "models"
BUNDLED = (
    "gpt2-shakespeare",
    "gpt2-shakespeare-draft",
    "llama-shakespeare",
)  # trained by llmcourse.training.train, shipped in MODELS_DIR
DEFAULT_MODEL = "gpt2-shakespeare"
HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
IGNORED_BUFFER = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")


def resolve_device(device: Union[str, torch.device] = "auto") -> torch.device:
    """'auto' -> CUDA when present, else CPU; anything else must name an available device."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use 'cpu' or 'auto'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported; use 'auto', 'cpu' or 'cuda'")
    return device


def resolve_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")


def load_model(
    source: Union[str, Path] = DEFAULT_MODEL,
    *,
    device: Union[str, torch.device] = "auto",
    dtype: Union[str, torch.dtype, None] = None,
    parts: Optional[Parts] = None,
    quantize: Optional[str] = None,
) -> Decoder:
    """A model (GPT-2 or the Llama family) from a local folder or a Hugging Face Hub name, ready for inference.

    `source`: a folder with `config.json` + `model.safetensors`; a bundled model's name
    ('gpt2-shakespeare', the default, 'gpt2-shakespeare-draft', 'llama-shakespeare'); or a Hub name such as
    'gpt2', 'distilgpt2', 'Qwen/Qwen2.5-0.5B', 'meta-llama/Llama-3.2-1B' (taken from the local Hugging Face
    cache; downloaded only if not cached and a network is reachable). `dtype` defaults to float32; it is the
    dtype of the activations and of whatever stays float. `quantize`: None, 'int8' or 'int4'
    (`llmcourse.engine.quantize`). On a CPU it sets torch's threads to the engine's choice unless someone chose
    (`llmcourse.engine.threads`).
    """
    threads.choose()
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    if quantize is not None:
        quantization.check_format(quantize)
    folder = resolve_source(source)
    saved = quantization.saved_format(folder / CONFIG_FILE)
    if saved is not None and saved not in quantization.FORMATS:
        raise CheckpointError(
            f"{folder / CONFIG_FILE}: quantization_config format {saved!r} is not one this engine reads "
            f"({', '.join(quantization.FORMATS)})"
        )
    if saved is not None and quantize not in (None, saved):
        raise CheckpointError(
            f"{folder} holds {saved} weights; quantizing them again to {quantize} would add the "
            f"errors of both: load it as it is (leave quantize out), or quantize the float checkpoint"
        )
    model, state = read_checkpoint(folder, parts or Parts())
    if saved is not None:
        quantization.empty_quantized(model, saved, smoothed=any(key.endswith(".smooth") for key in state))
    model.load_state_dict(check_weights(state, model, weight_files(folder)[0]))
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if quantize is not None and saved is None:
        quantization.quantize_model(model, quantize)
    return model


def read_checkpoint(folder: Path, parts: Parts) -> tuple[Decoder, dict[str, torch.Tensor]]:
    """The model config.json describes (its weights not loaded yet) and the checkpoint's tensors under the
    model's names."""
    model_type = read_config(folder).get("model_type", "gpt2")
    if model_type in FAMILIES:
        state, raw = parts.load_llama_checkpoint(folder)
        if (folder / GENERATION_FILE).is_file():  # the ids that end a reply, when they differ from config.json's
            eos = read_config_file(folder / GENERATION_FILE).get("eos_token_id")
            raw = {**raw, "eos_token_id": eos} if eos is not None else raw
        return Llama(LlamaConfig.from_dict(raw, str(folder / CONFIG_FILE)), parts), dict(state)
    config = GPT2Config.from_json(folder / CONFIG_FILE)
    state = {}
    for key, tensor in read_safetensors(folder).items():
        name = key.removeprefix("transformer.")
        if not IGNORED_BUFFER.match(name):
            state[name] = tensor
    head = state.pop("lm_head.weight", None)
    if (
        head is not None
        and "wte.weight" in state
        and not torch.equal(head.to(state["wte.weight"].dtype), state["wte.weight"])
    ):
        raise CheckpointError(
            f"{folder}: lm_head.weight differs from wte.weight; GPT-2 ties its output head to the token "
            "embedding and this engine needs them equal"
        )
    return GPT2(config, parts), state


def read_config_file(path: Path) -> dict:
    return read_config(path.parent) if path.name == CONFIG_FILE else json.loads(path.read_text(encoding="utf-8"))


def resolve_source(source: Union[str, Path]) -> Path:
    """The folder holding the checkpoint: `source` itself, a bundled model, or a Hub snapshot."""
    if str(source) in BUNDLED and not Path(source).is_dir():
        source = MODELS_DIR / str(source)
    path = Path(source).expanduser()
    if not path.exists() and (guess := close_bundled_name(str(source))):
        raise CheckpointError(
            f"no bundled model {str(source)!r}; did you mean {guess!r}? (bundled: {', '.join(BUNDLED)})"
        )
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file() or not any((path / f).is_file() for f in (WEIGHTS_FILE, INDEX_FILE)):
            missing = CONFIG_FILE if not (path / CONFIG_FILE).is_file() else WEIGHTS_FILE
            raise CheckpointError(
                f"{path} has no {missing}; a model folder needs config.json and model.safetensors, "
                "as transformers' save_pretrained writes them"
            )
        return path
    if path.exists() or not HUB_NAME.match(str(source)):
        raise CheckpointError(f"{source!r} is neither a model folder nor a Hugging Face Hub model name")
    return hub_snapshot(str(source))


def close_bundled_name(name: str) -> Optional[str]:
    """The bundled model `name` is probably a misspelling of, or None.

    Hub names such as 'gpt2', 'gpt2-medium' or 'distilgpt2' are not close to any bundled name, and
    names with an owner ('someone/gpt2-shakespeare') are always Hub names.
    """
    if name in BUNDLED or "/" in name:
        return None
    matches = difflib.get_close_matches(name.lower(), BUNDLED, n=1, cutoff=0.8)
    return matches[0] if matches else None


def hub_snapshot(name: str) -> Path:
    """The cached snapshot of Hub model `name`, downloading it only if a network is reachable."""
    try:
        from huggingface_hub import snapshot_download  # heavy (HTTP stack): only for a Hub model
    except ImportError:
        raise CheckpointError(
            f"loading {name!r} from the Hugging Face Hub needs the package huggingface_hub "
            "(pip install huggingface_hub), or pass a local model folder instead"
        ) from None
    files = [CONFIG_FILE, GENERATION_FILE, "*.safetensors", INDEX_FILE, *TOKENIZER_FILES]
    try:
        folder = Path(snapshot_download(name, allow_patterns=files, local_files_only=True))
        if (folder / CONFIG_FILE).is_file():
            return folder
    except Exception:
        pass  # not cached: try the network below
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        reason = "HF_HUB_OFFLINE is set"
    else:
        try:
            folder = Path(snapshot_download(name, allow_patterns=files, etag_timeout=10))
            if (folder / CONFIG_FILE).is_file() and any((folder / f).is_file() for f in (WEIGHTS_FILE, INDEX_FILE)):
                return folder
            reason = f"the Hub repository has no {WEIGHTS_FILE}"
        except Exception as err:  # no network, unknown repo, auth, ...
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": ")
    raise CheckpointError(
        f"model {name!r} is not in the local Hugging Face cache and could not be downloaded ({reason}).\n"
        f"  On a machine with a network: hf download {name} {CONFIG_FILE} {WEIGHTS_FILE}\n"
        "  then copy the cache (~/.cache/huggingface/hub) here; or use a local model folder or a bundled model\n"
        f"  ({', '.join(BUNDLED)}) instead."
    )


def check_weights(renamed: dict[str, torch.Tensor], model: Decoder, path: Path) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (under the model's keys) in the model's dtypes; refuses missing, extra or mis-shaped ones."""
    expected = model.state_dict()
    cfg = model.config
    summary = (
        f"config.json: n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, vocab_size={cfg.vocab_size}, "
        f"n_positions={cfg.n_positions}"
    )
    missing = [k for k in expected if k not in renamed]
    if missing:
        raise CheckpointError(f"{path}: missing tensor '{missing[0]}' ({len(missing)} missing in all; {summary})")
    unexpected = [k for k in renamed if k not in expected]
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected tensor '{unexpected[0]}' ({len(unexpected)} unexpected in all; {summary})"
        )
    for k, want in expected.items():
        if renamed[k].shape != want.shape:
            raise CheckpointError(
                f"{path}: tensor '{k}' has shape {tuple(renamed[k].shape)}, but {summary} needs {tuple(want.shape)}"
            )
    for k, want in expected.items():
        if want.dtype.is_floating_point != renamed[k].dtype.is_floating_point:
            raise CheckpointError(
                f"{path}: tensor '{k}' is {renamed[k].dtype}, but the model needs {want.dtype}; "
                "is config.json's quantization_config the one these weights were saved with?"
            )
    return {k: v.to(expected[k].dtype) for k, v in renamed.items()}


def save_model(model: Decoder, folder: Union[str, Path], *, dtype: Optional[torch.dtype] = None) -> Path:
    """Write `config.json` + `model.safetensors` as transformers' `save_pretrained` does for the model's family,
    optionally converting the float weights to `dtype` (e.g. float16 to halve the file). A quantized
    model's tensors are written as they are, and config.json names their format."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(model, Llama):
        (folder / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n", encoding="utf-8")
    else:
        model.config.to_json(folder / CONFIG_FILE)
    fmt = quantization.quantized_format(model)
    if fmt:
        config = json.loads((folder / CONFIG_FILE).read_text())
        config[quantization.CONFIG_KEY] = quantization.config_entry(fmt)
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")

    def stored(k: str, v: torch.Tensor) -> torch.Tensor:
        keep = (
            not v.is_floating_point() or k.endswith("scales") and v.dtype == torch.float16
        )  # int4 scales stay float16
        return v.detach().to("cpu", v.dtype if keep else dtype or v.dtype).contiguous()

    def key(k: str) -> str:  # the names transformers' classes load
        if isinstance(model, GPT2):
            return f"transformer.{k}"
        return k if k.startswith("lm_head.") else f"model.{k}"

    tensors = {key(k): stored(k, v) for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    return folder
