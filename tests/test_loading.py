"""Loading checkpoints written by transformers, and refusing broken ones with a precise error."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmcourse import CheckpointError, GPT2Config, load_model
from llmcourse.engine.loading import close_bundled_name, resolve_device, resolve_dtype

from .conftest import lively_model


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """A GPT-2 written by transformers' own save_pretrained (random weights, small config)."""
    from transformers import GPT2Config as HFConfig
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(HFConfig(n_layer=2, n_head=2, n_embd=32, n_positions=64)).eval()
    folder = tmp_path_factory.mktemp("hf_saved")
    hf.save_pretrained(folder)
    return folder, hf


def test_loads_what_save_pretrained_writes(hf_saved):
    folder, hf = hf_saved
    model = load_model(folder, device="cpu")
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd) == (2, 2, 32)
    ids = torch.randint(0, 50257, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-4
    assert not any(p.requires_grad for p in model.parameters())


def copy_folder(folder, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(folder, target)
    return target


def rewrite_weights(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def test_keys_without_prefix_explicit_head_and_old_buffers_load(hf_saved, tmp_path):
    folder = copy_folder(hf_saved[0], tmp_path)

    def as_original_gpt2_checkpoint(t):
        for key in list(t):
            t[key.removeprefix("transformer.")] = t.pop(key)
        t["lm_head.weight"] = t["wte.weight"].clone()
        t["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))  # causal-mask buffer old checkpoints hold

    rewrite_weights(folder, as_original_gpt2_checkpoint)
    model = load_model(folder, device="cpu")
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert (model(ids) - hf_saved[1](ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("transformer.h.1.mlp.c_proj.bias"), r"missing tensor 'h\.1\.mlp\.c_proj\.bias'"),
        (
            lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(32)}),
            r"unexpected tensor 'h\.2\.ln_1\.weight'",
        ),
        (
            lambda t: t.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(32, 64)}),
            r"tensor 'h\.0\.attn\.c_attn\.weight' has shape \(32, 64\).*needs \(32, 96\)",
        ),
        (lambda t: t.update({"lm_head.weight": torch.zeros(50257, 32)}), r"lm_head\.weight differs from wte\.weight"),
    ],
)
def test_broken_checkpoint_names_the_tensor(hf_saved, tmp_path, change, message):
    folder = copy_folder(hf_saved[0], tmp_path)
    rewrite_weights(folder, change)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, device="cpu")


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_layer": 3}, r"missing tensor 'h\.2\..*n_layer=3"),
        ({"n_embd": 48}, r"has shape .* needs"),
        ({"vocab_size": 50000}, r"'wte\.weight' has shape \(50257, 32\).*vocab_size=50000.*needs \(50000, 32\)"),
        ({"n_head": 5}, r"n_embd \(32\) must be divisible by n_head \(5\)"),
        ({"model_type": "bert"}, r"model_type is 'bert'; this engine runs GPT-2 \('gpt2'\) and the Llama family"),
        ({"model_type": "llama"}, r"config\.json: missing 'num_hidden_layers'"),
        ({"activation_function": "relu"}, r"activation_function 'relu' is not supported"),
    ],
)
def test_config_that_does_not_fit_is_refused(hf_saved, tmp_path, changes, message):
    folder = copy_folder(hf_saved[0], tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_model(folder, device="cpu")


def test_corrupt_or_missing_files(hf_saved, tmp_path):
    folder = copy_folder(hf_saved[0], tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"cannot read .*model\.safetensors.*corrupt or truncated"):
        load_model(folder, device="cpu")
    weights.unlink()
    with pytest.raises(CheckpointError, match=r"has no model\.safetensors"):
        load_model(folder, device="cpu")
    (folder / "config.json").write_text("{not json")
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"cannot read .*config\.json"):
        load_model(folder, device="cpu")


def test_not_a_folder_nor_a_hub_name(tmp_path):
    with pytest.raises(CheckpointError, match="neither a model folder nor a Hugging Face Hub model name"):
        load_model(str(tmp_path / "no" / "such" / "folder"), device="cpu")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="neither a model folder"):
        load_model(tmp_path / "file.txt", device="cpu")


def fake_hub_cache(root, repo, folder):
    """Lay out `folder` as huggingface_hub caches a downloaded repository."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folder / name, snapshot / name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)


def test_hub_name_resolves_from_the_local_cache_offline(hf_saved, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    fake_hub_cache(tmp_path, "someone/tiny-gpt2", hf_saved[0])
    model = load_model("someone/tiny-gpt2", device="cpu")
    assert model.config.n_embd == 32


def test_hub_name_not_cached_offline_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(
        CheckpointError,
        match=r"(?s)'gpt2' is not in the local Hugging Face cache.*hf download gpt2.*local model folder",
    ):
        load_model("gpt2", device="cpu")


@pytest.mark.parametrize(
    "name, meant",
    [
        ("gpt2-shakespear", "gpt2-shakespeare"),
        ("shakespeare", "gpt2-shakespeare"),
        ("GPT2-Shakespeare", "gpt2-shakespeare"),
        ("gpt2_shakespeare", "gpt2-shakespeare"),
        ("gpt2-shakespeare-drft", "gpt2-shakespeare-draft"),
    ],
)
def test_a_misspelt_bundled_name_says_what_was_meant(name, meant, monkeypatch):
    monkeypatch.setattr("llmcourse.engine.loading.hub_snapshot", lambda name: pytest.fail("went to the Hub"))
    with pytest.raises(CheckpointError) as err:
        load_model(name, device="cpu")
    assert str(err.value) == (
        f"no bundled model {name!r}; did you mean {meant!r}? "
        "(bundled: gpt2-shakespeare, gpt2-shakespeare-draft, llama-shakespeare)"
    )


def test_hub_names_and_folders_are_not_taken_for_misspellings(tmp_path, monkeypatch):
    for name in [
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "distilgpt2",
        "someone/gpt2-shakespeare",
        "gpt2-shakespeare",
        "gpt2-shakespeare-draft",
    ]:
        assert close_bundled_name(name) is None, name
    asked = []
    monkeypatch.setattr(
        "llmcourse.engine.loading.hub_snapshot", lambda name: asked.append(name) or pytest.skip("no hub")
    )
    monkeypatch.chdir(tmp_path)
    from llmcourse import save_model

    save_model(
        lively_model(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=300)), "gpt2-shakespear"
    )
    assert load_model("gpt2-shakespear", device="cpu").config.n_embd == 16  # a folder of that name
    with pytest.raises(pytest.skip.Exception):
        load_model("gpt2-medium", device="cpu")
    assert asked == ["gpt2-medium"]


def test_device_and_dtype_errors():
    with pytest.raises(ValueError, match="dtype 'float8' is not supported; use one of float32, float16, bfloat16"):
        resolve_dtype("float8")
    with pytest.raises(ValueError, match="is not a device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is available"):
            resolve_device("cuda")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_save_model_round_trip_is_exact(tmp_path):
    from llmcourse import save_model

    model = lively_model(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32, vocab_size=300), seed=3)
    again = load_model(save_model(model, tmp_path), device="cpu")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert GPT2Config.from_json(tmp_path / "config.json") == model.config
