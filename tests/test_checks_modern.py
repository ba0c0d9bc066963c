"""Chapter 11's checks: the references pass (visible and hidden parts), stubs fail, plausible mistakes fail with a
message that names them, other correct ways of writing each exercise pass, black boxes are refused, a learner's
part that breaks the engine's contract is stopped by its guard; and the solution notebook passes its own checks."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from llmcourse.checks import CheckFailed
from llmcourse.checks.modern import (
    check_grouped_attention,
    check_llama_block,
    check_load_llama_checkpoint,
    check_qk_norm,
    check_repeat_kv,
    check_rms_norm,
    check_rope_frequencies,
    check_swiglu,
    tiny_config,
    tiny_llama,
)
from llmcourse.course.guards import guarded
from llmcourse.engine.parts import Parts, causal_mask
from llmcourse.engine.slots import PartError

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "solutions/11_modern/11_modern.ipynb"
pytestmark = pytest.mark.usefixtures("one_thread")


# -- references, written as a learner would ----------------------------------------------------------------------


def rms_norm(x, weight, eps):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def swiglu(gate, up):
    return gate * torch.sigmoid(gate) * up


def repeat_kv(x, n_rep):
    B, H_kv, T, D = x.shape
    return x[:, :, None].expand(B, H_kv, n_rep, T, D).reshape(B, H_kv * n_rep, T, D)


def grouped_attention(q, k, v, mask, attention):
    B, H, T, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    n_rep = H // H_kv
    if n_rep == 1:
        return attention(q, k, v, mask)
    rows = q.reshape(B, H_kv, n_rep * T, D)  # row r*T + t: the group's r-th head at position t
    if mask is None:
        mask = causal_mask(T, Tk).repeat(n_rep, 1)
    else:
        mask = mask.expand(B, H, T, Tk).reshape(B, H_kv, n_rep * T, Tk)
    out = attention(rows, k, v, mask)  # k and v as given: each KV head read once
    return out.reshape(B, H, T, out.shape[-1])


def qk_norm(q, k, q_weight, k_weight, eps):
    return rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)


def rope_frequencies(head_dim, rope_theta, rope_scaling):
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    scaling = rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelength = 2 * math.pi / inv_freq
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        slow, fast = wavelength > original / low, wavelength < original / high
        return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))
    return inv_freq


def llama_block(x, layer, config, rope, attend, parts):
    p, attn, eps = parts, layer.self_attn, config.rms_norm_eps
    h = p.rms_norm(x, layer.input_layernorm.weight, eps)
    q = p.split_heads(attn.q_proj(h, p.linear), config.n_head)
    k = p.split_heads(attn.k_proj(h, p.linear), config.n_kv_head)
    v = p.split_heads(attn.v_proj(h, p.linear), config.n_kv_head)
    if config.qk_norm:
        q, k = p.qk_norm(q, k, attn.q_norm.weight, attn.k_norm.weight, eps)
    x = x + attn.o_proj(p.merge_heads(attend(rope(q), rope(k), v)), p.linear)
    h = p.rms_norm(x, layer.post_attention_layernorm.weight, eps)
    mlp = layer.mlp
    return x + mlp.down_proj(p.swiglu(mlp.gate_proj(h, p.linear), mlp.up_proj(h, p.linear)), p.linear)


def weight_files(folder):
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    index = json.loads((folder / "model.safetensors.index.json").read_text(encoding="utf-8"))
    return [folder / name for name in dict.fromkeys(index["weight_map"].values())]


def load_llama_checkpoint(folder):
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    state = {}
    for file in weight_files(folder):
        for key, tensor in load_file(file).items():
            if key.endswith("rotary_emb.inv_freq"):
                continue
            state[key.removeprefix("model.")] = tensor
    if config.get("tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state, config


REFERENCES = [
    (check_rms_norm, rms_norm, dict(n_random=40, transformers=True)),
    (check_swiglu, swiglu, dict(n_random=40)),
    (check_repeat_kv, repeat_kv, dict(n_random=40, transformers=True)),
    (check_grouped_attention, grouped_attention, dict(n_random=40)),
    (check_qk_norm, qk_norm, dict(n_random=40)),
    (check_rope_frequencies, rope_frequencies, dict(n_random=40, transformers=True)),
    (check_llama_block, llama_block, dict(n_random=10, transformers=True)),
    (check_load_llama_checkpoint, load_llama_checkpoint, dict(transformers=True)),
]
IDS = [check.__name__ for check, _, _ in REFERENCES]


@pytest.mark.parametrize("check, reference, hidden", REFERENCES, ids=IDS)
def test_reference_passes_visible_and_hidden(check, reference, hidden, capsys):
    check(reference)
    check(reference, seed=101, **hidden)
    assert capsys.readouterr().out.count("✓") == 2


def stub(*args, **kwargs):
    raise NotImplementedError()


@pytest.mark.parametrize("check", [c for c, _, _ in REFERENCES], ids=IDS)
def test_stub_is_not_written_yet(check):
    with pytest.raises(CheckFailed, match="is not written yet"):
        check(stub)


@pytest.mark.parametrize(
    "check, engine_part",
    [
        (check_rms_norm, "rms_norm"),
        (check_swiglu, "swiglu"),
        (check_repeat_kv, "repeat_kv"),
        (check_grouped_attention, "grouped_attention"),
        (check_qk_norm, "qk_norm"),
        (check_rope_frequencies, "rope_frequencies"),
        (check_llama_block, "llama_block"),
    ],
)
def test_the_engines_own_part_is_refused(check, engine_part):
    from llmcourse.engine import parts

    with pytest.raises(CheckFailed, match="is what yours is compared with"):
        check(getattr(parts, engine_part))


# -- plausible mistakes, each rejected with a message that names it ----------------------------------------------


def rms_layer_norm(x, weight, eps):
    x32 = x.float()
    mean = x32.mean(-1, keepdim=True)
    normed = (x32 - mean) * torch.rsqrt(((x32 - mean) ** 2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_eps_outside(x, weight, eps):
    x32 = x.float()
    return weight * (x32 / (x32.pow(2).mean(-1, keepdim=True).sqrt() + eps)).to(x.dtype)


def rms_in_float16(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rms_weight_before_cast(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rms_one_plus_weight(x, weight, eps):
    return rms_norm(x, 1 + weight, eps)


def rms_sum_not_mean(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rms_returns_float32(x, weight, eps):
    if x.dtype not in (torch.float16, torch.bfloat16):
        return rms_norm(x, weight, eps)
    x32 = x.float()
    return weight.float() * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # float16 in, float32 out


def rms_with_view(x, weight, eps):
    return rms_norm(x.view(-1, x.shape[-1]), weight, eps).view(x.shape)


def rms_fixed_eps(x, weight, eps):
    return rms_norm(x, weight, 1e-6)


def rms_with_f_rms_norm(x, weight, eps):
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype) * weight


def swiglu_swapped(gate, up):
    return up * torch.sigmoid(up) * gate


def swiglu_glu(gate, up):
    return torch.sigmoid(gate) * up


def swiglu_gelu(gate, up):
    return 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3))) * up


def swiglu_exp_sigmoid(gate, up):
    e = torch.exp(gate)
    return gate * e / (1 + e) * up  # inf / inf for large gates


def swiglu_with_f_silu(gate, up):
    return F.silu(gate) * up


def swiglu_in_float32(gate, up):
    if gate.dtype not in (torch.float16, torch.bfloat16):
        return swiglu(gate, up)
    return gate.float() * torch.sigmoid(gate.float()) * up.float()  # float16 in, float32 out


def repeat_tiled(x, n_rep):
    return x.repeat(1, n_rep, 1, 1)


def repeat_cat(x, n_rep):
    return torch.cat([x] * n_rep, dim=1)


def repeat_positions(x, n_rep):
    return x.repeat_interleave(n_rep, dim=2)


def repeat_with_view(x, n_rep):
    B, H_kv, T, D = x.shape
    return x.view(B, H_kv, 1, T * D).expand(B, H_kv, n_rep, T * D).reshape(B, H_kv * n_rep, T, D)


def repeat_expand_wrong_axis(x, n_rep):
    B, H_kv, T, D = x.shape
    return x[:, None].expand(B, n_rep, H_kv, T, D).reshape(B, H_kv * n_rep, T, D)  # tiles


def qk_norm_over_heads(q, k, q_weight, k_weight, eps):
    def norm(t, w):
        B, H, T, D = t.shape
        flat = t.transpose(1, 2).reshape(B, T, H * D)  # every head of a position together
        return rms_norm(flat, w.repeat(H), eps).view(B, T, H, D).transpose(1, 2)

    return norm(q, q_weight), norm(k, k_weight)


def qk_norm_one_weight(q, k, q_weight, k_weight, eps):
    return rms_norm(q, q_weight, eps), rms_norm(k, q_weight, eps)


def qk_norm_q_only(q, k, q_weight, k_weight, eps):
    return rms_norm(q, q_weight, eps), k


def qk_norm_swapped(q, k, q_weight, k_weight, eps):
    return rms_norm(k, k_weight, eps), rms_norm(q, q_weight, eps)


def qk_norm_returns_list(q, k, q_weight, k_weight, eps):
    return [rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)]  # a list is a pair too: accepted


def qk_norm_in_half(q, k, q_weight, k_weight, eps):
    return rms_in_float16(q, q_weight, eps), rms_in_float16(k, k_weight, eps)


def _attn(h, layer, config, rope, attend, parts, *, rope_first=False, skip_norm=False, v_rope=False):
    p, attn = parts, layer.self_attn
    q = p.split_heads(attn.q_proj(h, p.linear), config.n_head)
    k = p.split_heads(attn.k_proj(h, p.linear), config.n_kv_head)
    v = p.split_heads(attn.v_proj(h, p.linear), config.n_kv_head)
    if rope_first:
        q, k = rope(q), rope(k)
    if config.qk_norm and not skip_norm:
        q, k = p.qk_norm(q, k, attn.q_norm.weight, attn.k_norm.weight, config.rms_norm_eps)
    if not rope_first:
        q, k = rope(q), rope(k)
    return attn.o_proj(p.merge_heads(attend(q, k, rope(v) if v_rope else v)), p.linear)


def _mlp(h, layer, parts, act=None):
    m, p = layer.mlp, parts
    if act is not None:
        return m.down_proj(act(m.up_proj(h, p.linear)), p.linear)
    return m.down_proj(p.swiglu(m.gate_proj(h, p.linear), m.up_proj(h, p.linear)), p.linear)


def block_post_norm(x, layer, config, rope, attend, parts):
    eps = config.rms_norm_eps
    x = parts.rms_norm(x + _attn(x, layer, config, rope, attend, parts), layer.input_layernorm.weight, eps)
    return parts.rms_norm(x + _mlp(x, layer, parts), layer.post_attention_layernorm.weight, eps)


def block_rope_before_norm(x, layer, config, rope, attend, parts):
    eps = config.rms_norm_eps
    h = parts.rms_norm(x, layer.input_layernorm.weight, eps)
    x = x + _attn(h, layer, config, rope, attend, parts, rope_first=True)
    return x + _mlp(parts.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, parts)


def block_no_attention_residual(x, layer, config, rope, attend, parts):
    eps = config.rms_norm_eps
    x = _attn(parts.rms_norm(x, layer.input_layernorm.weight, eps), layer, config, rope, attend, parts)
    return x + _mlp(parts.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, parts)


def block_gelu_mlp(x, layer, config, rope, attend, parts):
    eps = config.rms_norm_eps
    x = x + _attn(parts.rms_norm(x, layer.input_layernorm.weight, eps), layer, config, rope, attend, parts)
    h = parts.rms_norm(x, layer.post_attention_layernorm.weight, eps)
    return x + _mlp(h, layer, parts, act=lambda t: F.gelu(t, approximate="tanh"))


def block_ignores_qk_norm(x, layer, config, rope, attend, parts):
    eps = config.rms_norm_eps
    h = parts.rms_norm(x, layer.input_layernorm.weight, eps)
    x = x + _attn(h, layer, config, rope, attend, parts, skip_norm=True)
    return x + _mlp(parts.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, parts)


def block_kv_with_n_head(x, layer, config, rope, attend, parts):
    p, attn, eps = parts, layer.self_attn, config.rms_norm_eps
    h = p.rms_norm(x, layer.input_layernorm.weight, eps)
    q = p.split_heads(attn.q_proj(h, p.linear), config.n_head)
    k = p.split_heads(attn.k_proj(h, p.linear), config.n_head)
    v = p.split_heads(attn.v_proj(h, p.linear), config.n_head)
    x = x + attn.o_proj(p.merge_heads(attend(rope(q), rope(k), v)), p.linear)
    return x + _mlp(p.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, p)


def block_in_place(x, layer, config, rope, attend, parts):
    eps = config.rms_norm_eps  # += below writes into the caller's x
    x += _attn(parts.rms_norm(x, layer.input_layernorm.weight, eps), layer, config, rope, attend, parts)
    x += _mlp(parts.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, parts)
    return x


def block_repeats_kv_itself(x, layer, config, rope, attend, parts):
    p, attn, eps = parts, layer.self_attn, config.rms_norm_eps
    h = p.rms_norm(x, layer.input_layernorm.weight, eps)
    q = p.split_heads(attn.q_proj(h, p.linear), config.n_head)
    k = repeat_kv(p.split_heads(attn.k_proj(h, p.linear), config.n_kv_head), config.n_rep)  # chapter 11's warm-up
    v = repeat_kv(p.split_heads(attn.v_proj(h, p.linear), config.n_kv_head), config.n_rep)
    x = x + attn.o_proj(p.merge_heads(attend(rope(q), rope(k), v)), p.linear)
    return x + _mlp(p.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, p)


def rms_remembers_eps(x, weight, eps, _seen={}):
    key = id(x)
    _seen.setdefault(key, eps)  # the eps of the first call on this x
    return rms_norm(x, weight, _seen[key])


def repeat_remembers(x, n_rep, _seen={}):
    if id(x) not in _seen:
        _seen[id(x)] = repeat_kv(x, n_rep)
    return _seen[id(x)]


def block_own_attention(x, layer, config, rope, attend, parts):
    """Chapter 04's habit: attention built from the parts, causal, with the KV heads repeated — but not `attend`,
    so nothing reaches the KV cache."""
    from llmcourse.engine.parts import attention

    p, a, eps = parts, layer.self_attn, config.rms_norm_eps
    h = p.rms_norm(x, layer.input_layernorm.weight, eps)
    q = p.split_heads(a.q_proj(h, p.linear), config.n_head)
    k = p.split_heads(a.k_proj(h, p.linear), config.n_kv_head)
    v = p.split_heads(a.v_proj(h, p.linear), config.n_kv_head)
    if config.qk_norm:
        q, k = p.qk_norm(q, k, a.q_norm.weight, a.k_norm.weight, eps)
    n_rep = config.n_head // config.n_kv_head
    out = attention(rope(q), repeat_kv(rope(k), n_rep), repeat_kv(v, n_rep), None)
    x = x + a.o_proj(p.merge_heads(out), p.linear)
    return x + _mlp(p.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, p)


def load_tie_key_required(folder):
    state, config = load_llama_checkpoint(folder)
    if not config["tie_word_embeddings"]:
        pass
    return state, config


def block_weights_only(x, layer, config, rope, attend, parts):
    """The projections as bare matrix products: Qwen2's biases left out."""
    p, a, eps = parts, layer.self_attn, config.rms_norm_eps
    h = p.rms_norm(x, layer.input_layernorm.weight, eps)
    q = p.split_heads(h @ a.q_proj.weight.T, config.n_head)
    k = p.split_heads(h @ a.k_proj.weight.T, config.n_kv_head)
    v = p.split_heads(h @ a.v_proj.weight.T, config.n_kv_head)
    if config.qk_norm:
        q, k = p.qk_norm(q, k, a.q_norm.weight, a.k_norm.weight, eps)
    x = x + a.o_proj(p.merge_heads(attend(rope(q), rope(k), v)), p.linear)
    return x + _mlp(p.rms_norm(x, layer.post_attention_layernorm.weight, eps), layer, p)


def block_fixed_eps(x, layer, config, rope, attend, parts):
    import dataclasses

    return llama_block(x, layer, dataclasses.replace(config, rms_norm_eps=1e-6), rope, attend, parts)


def load_keeping_prefix(folder):
    config = json.loads((Path(folder) / "config.json").read_text())
    state = {}
    for file in weight_files(folder):
        state.update({k: v for k, v in load_file(file).items() if not k.endswith("inv_freq")})
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return state, config


def load_always_tied(folder):
    state, config = load_llama_checkpoint(folder)
    state.pop("lm_head.weight", None)  # GPT-2's habit: the head is the token table
    return state, config


def load_never_dropping_head(folder):
    config = json.loads((Path(folder) / "config.json").read_text())
    state = {}
    for file in weight_files(folder):
        state.update({k.removeprefix("model."): v for k, v in load_file(file).items() if not k.endswith("inv_freq")})
    return state, config


def load_single_file(folder):
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    state = {k.removeprefix("model."): v for k, v in load_file(folder / "model.safetensors").items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return state, config


def load_first_shard(folder):
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    state = {}
    for key, tensor in load_file(weight_files(folder)[0]).items():
        if not key.endswith("inv_freq"):
            state[key.removeprefix("model.")] = tensor
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return state, config


def load_keeping_inv_freq(folder):
    config = json.loads((Path(folder) / "config.json").read_text())
    state = {}
    for file in weight_files(folder):
        state.update({k.removeprefix("model."): v for k, v in load_file(file).items()})
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return state, config


def load_to_float32(folder):
    state, config = load_llama_checkpoint(folder)
    return {k: v.float() for k, v in state.items()}, config


def load_transposing(folder):
    state, config = load_llama_checkpoint(folder)
    return {k: v.T.contiguous() if k.endswith("proj.weight") else v for k, v in state.items()}, config


def rms_in_place_after_float(x, weight, eps):
    x32 = x.float()  # for a float32 x, x.float() is x itself: *= below changes the caller's tensor
    x32 *= torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def swiglu_in_place(gate, up):
    up *= gate * torch.sigmoid(gate)  # the caller's up
    return up


def _load_files(folder, files):
    """The engine's names and config.json, from these safetensors files in order."""
    config = json.loads((Path(folder) / "config.json").read_text())
    state = {}
    for file in files:
        state.update({k.removeprefix("model."): v for k, v in load_file(file).items() if not k.endswith("inv_freq")})
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    return state, config


def load_every_safetensors(folder):
    return _load_files(folder, sorted(Path(folder).glob("*.safetensors")))  # shards, and whatever lies beside them


def load_index_else_every_safetensors(folder):
    folder = Path(folder)
    if (folder / "model.safetensors.index.json").is_file():
        return _load_files(folder, weight_files(folder))
    return _load_files(folder, sorted(folder.glob("*.safetensors")))  # model.safetensors and an adapter


def load_every_shard_by_name(folder):
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return _load_files(folder, [folder / "model.safetensors"])
    return _load_files(folder, sorted(folder.glob("model-*.safetensors")))  # an old shard too, not in the index


def _group(q, k):
    B, H, T, D = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    return B, H, T, D, H_kv, H // H_kv, Tk


def _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep):
    if mask is None:
        return causal_mask(T, Tk).repeat(n_rep, 1)
    return mask.expand(B, H, T, Tk).reshape(B, H_kv, n_rep * T, Tk)


def grouped_repeats_kv(q, k, v, mask, attention):
    n_rep = q.shape[1] // k.shape[1]
    return attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)  # chapter 11's first version: copies


def grouped_heads_tiled(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    rows = q.reshape(B, n_rep, H_kv, T, D).transpose(1, 2).reshape(B, H_kv, n_rep * T, D)  # head h -> KV h % H_kv
    if mask is None:
        m = causal_mask(T, Tk).repeat(n_rep, 1)
    else:
        m = mask.expand(B, H, T, Tk).reshape(B, n_rep, H_kv, T, Tk).transpose(1, 2).reshape(B, H_kv, n_rep * T, Tk)
    out = attention(rows, k, v, m).view(B, H_kv, n_rep, T, D)
    return out.transpose(1, 2).reshape(B, H, T, D)


def grouped_passes_none(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    m = None if mask is None else _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep)
    return attention(q.reshape(B, H_kv, n_rep * T, D), k, v, m).reshape(B, H, T, D)


def grouped_unshifted_tril(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    if mask is None:
        m = torch.ones(T, Tk, dtype=torch.bool).tril().repeat(n_rep, 1)  # queries taken as the first T positions
    else:
        m = _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep)
    return attention(q.reshape(B, H_kv, n_rep * T, D), k, v, m).reshape(B, H, T, D)


def grouped_mask_interleaved(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    if mask is None:
        m = causal_mask(T, Tk).repeat_interleave(n_rep, dim=0)  # row t*n_rep + r, but q's rows are r*T + t
    else:
        m = mask.expand(B, H, T, Tk).reshape(B, H_kv, n_rep, T, Tk).transpose(2, 3).reshape(B, H_kv, n_rep * T, Tk)
    return attention(q.reshape(B, H_kv, n_rep * T, D), k, v, m).reshape(B, H, T, D)


def grouped_rows_by_position(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    rows = q.reshape(B, H_kv, n_rep, T, D).transpose(2, 3).reshape(B, H_kv, T * n_rep, D)  # row t*n_rep + r
    out = attention(rows, k, v, _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep))  # ... and the mask r-major
    return out.view(B, H_kv, T, n_rep, D).transpose(2, 3).reshape(B, H, T, D)


def grouped_heads_back_swapped(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    out = attention(q.reshape(B, H_kv, n_rep * T, D), k, v, _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep))
    return out.view(B, H_kv, n_rep, T, D).transpose(1, 2).reshape(B, H, T, D)  # head r*H_kv + g


def grouped_not_grouped(q, k, v, mask, attention):
    return attention(q, k, v, mask)  # H query heads against H_kv key heads


def grouped_with_sdpa(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    m = causal_mask(T, Tk) if mask is None else mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)


def grouped_with_engine_attention(q, k, v, mask, attention):
    from llmcourse.engine import parts

    return grouped_attention(q, k, v, mask, parts.attention)  # not the attention it was given


def grouped_own_attention(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    rows = q.reshape(B, H_kv, n_rep * T, D)
    m = _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep)
    scores = (rows @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~m, float("-inf"))
    return (torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v).reshape(B, H, T, D)


def grouped_one_call_per_head(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    m = causal_mask(T, Tk) if mask is None else mask.expand(B, H, T, Tk)
    outs = []
    for h in range(H):  # views, no copies, but each KV head read n_rep times
        g = h // n_rep
        mh = m if mask is None else m[:, h : h + 1]
        outs.append(attention(q[:, h : h + 1], k[:, g : g + 1], v[:, g : g + 1], mh))
    return torch.cat(outs, dim=1)


def grouped_contiguous_kv(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    m = _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep)
    out = attention(q.reshape(B, H_kv, n_rep * T, D), k.contiguous(), v.contiguous(), m)  # copies a cache's slice
    return out.reshape(B, H, T, D)


def grouped_q_in_place(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    q.mul_(1.0 / math.sqrt(D))  # pre-scaled in place: the caller's q
    return grouped_attention(q * math.sqrt(D), k, v, mask, attention)


def grouped_q_view(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    out = attention(q.view(B, H_kv, n_rep * T, D), k, v, _tiled_mask(mask, B, H, T, Tk, H_kv, n_rep))
    return out.view(B, H, T, D)


def grouped_mask_untiled(q, k, v, mask, attention):
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    m = causal_mask(T, Tk).repeat(n_rep, 1) if mask is None else mask  # a given mask passed as it is
    return attention(q.reshape(B, H_kv, n_rep * T, D), k, v, m).reshape(B, H, T, D)


def grouped_decode_kernel(q, k, v, mask, attention):
    from llmcourse.engine.cpu_kernels import decode_attention

    if q.shape[2] == 1:
        return decode_attention(q, k, v, mask)  # groups the heads itself
    return grouped_attention(q, k, v, mask, attention)


def _rope_speeds(head_dim, theta, dtype=torch.float64):
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)


def _llama3_parts(scaling):
    s = scaling
    return s["factor"], s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]


def rope_linear_multiplies(head_dim, rope_theta, rope_scaling):
    scaling = rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        return _rope_speeds(head_dim, rope_theta) * scaling["factor"]
    return rope_frequencies(head_dim, rope_theta, rope_scaling)


def rope_llama3_as_linear(head_dim, rope_theta, rope_scaling):
    scaling = rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "llama3"):
        return _rope_speeds(head_dim, rope_theta) / scaling["factor"]
    return _rope_speeds(head_dim, rope_theta)


def _llama3_written(head_dim, rope_theta, rope_scaling, *, swap=False, ratio=False, weights=False, everywhere=False):
    scaling = rope_scaling or {}
    if scaling.get("rope_type") != "llama3":
        return rope_frequencies(head_dim, rope_theta, rope_scaling)
    inv_freq = _rope_speeds(head_dim, rope_theta)
    factor, original, low, high = _llama3_parts(scaling)
    wavelength = 2 * math.pi / inv_freq
    smooth = ((wavelength / original if ratio else original / wavelength) - low) / (high - low)
    if weights:
        smooth = 1 - smooth
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    if everywhere:
        return blended
    slow, fast = wavelength > original / low, wavelength < original / high
    if swap:
        slow, fast = fast, slow
    return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))


def rope_bands_swapped(head_dim, rope_theta, rope_scaling):
    return _llama3_written(head_dim, rope_theta, rope_scaling, swap=True)


def rope_smooth_wavelength_over_original(head_dim, rope_theta, rope_scaling):
    return _llama3_written(head_dim, rope_theta, rope_scaling, ratio=True)


def rope_blend_weights_swapped(head_dim, rope_theta, rope_scaling):
    return _llama3_written(head_dim, rope_theta, rope_scaling, weights=True)


def rope_blend_everywhere(head_dim, rope_theta, rope_scaling):
    return _llama3_written(head_dim, rope_theta, rope_scaling, everywhere=True)


def rope_wavelength_without_two_pi(head_dim, rope_theta, rope_scaling):
    scaling = rope_scaling or {}
    if scaling.get("rope_type") != "llama3":
        return rope_frequencies(head_dim, rope_theta, rope_scaling)
    inv_freq = _rope_speeds(head_dim, rope_theta)
    factor, original, low, high = _llama3_parts(scaling)
    wavelength = 1 / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    slow, fast = wavelength > original / low, wavelength < original / high
    return torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))


def rope_llama31_constants(head_dim, rope_theta, rope_scaling):
    scaling = rope_scaling or {}
    if scaling.get("rope_type") == "llama3":
        scaling = {**scaling, "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return rope_frequencies(head_dim, rope_theta, scaling)


def rope_theta_ignored(head_dim, rope_theta, rope_scaling):
    return rope_frequencies(head_dim, 10000.0, rope_scaling)


def rope_exponent_i_over_d(head_dim, rope_theta, rope_scaling):
    inv_freq = 1.0 / rope_theta ** (torch.arange(head_dim // 2, dtype=torch.float64) / head_dim)
    return inv_freq * (rope_frequencies(head_dim, rope_theta, rope_scaling) / _rope_speeds(head_dim, rope_theta))


def rope_in_float32(head_dim, rope_theta, rope_scaling):
    scaling = rope_scaling or {}
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)  # float32 on the way
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    if scaling.get("rope_type") == "llama3":
        factor, original, low, high = _llama3_parts(scaling)
        wavelength = 2 * math.pi / inv_freq
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        slow, fast = wavelength > original / low, wavelength < original / high
        inv_freq = torch.where(slow, inv_freq / factor, torch.where(fast, inv_freq, blended))
    return inv_freq.double()


def rope_returns_float32(head_dim, rope_theta, rope_scaling):
    return rope_frequencies(head_dim, rope_theta, rope_scaling).float()


def rope_none_crashes(head_dim, rope_theta, rope_scaling):
    if rope_scaling["rope_type"] == "default":
        return _rope_speeds(head_dim, rope_theta)
    return rope_frequencies(head_dim, rope_theta, rope_scaling)


def rope_default_needs_factor(head_dim, rope_theta, rope_scaling):
    if rope_scaling is None:
        return _rope_speeds(head_dim, rope_theta)
    if rope_scaling.get("rope_type") == "llama3":
        return rope_frequencies(head_dim, rope_theta, rope_scaling)
    return _rope_speeds(head_dim, rope_theta) / rope_scaling["factor"]  # "default" has none


def rope_pops_the_kind(head_dim, rope_theta, rope_scaling):
    kind = rope_scaling.pop("rope_type") if rope_scaling else "default"  # changes the caller's dict
    return rope_frequencies(head_dim, rope_theta, None if kind == "default" else {**rope_scaling, "rope_type": kind})


def rope_one_per_dimension(head_dim, rope_theta, rope_scaling):
    return 1.0 / rope_theta ** (torch.arange(head_dim, dtype=torch.float64) / head_dim)


def rope_engine_speeds(head_dim, rope_theta, rope_scaling):
    from llmcourse.engine.positions import rope_inv_freq

    return rope_inv_freq(head_dim, rope_theta)  # the engine's unscaled speeds


MISTAKES = [
    (check_grouped_attention, grouped_repeats_kv, r"reads each KV head n_rep = \d times[\s\S]*repeat_kv's copies"),
    (check_grouped_attention, grouped_heads_tiled, r"query head h reads KV head h // n_rep[\s\S]*h % H_kv"),
    (check_grouped_attention, grouped_passes_none, r"attention's own None would take the n_rep · T grouped rows"),
    (check_grouped_attention, grouped_unshifted_tril, r"torch\.ones\(T, Tk\)\.tril\(\) lets it see only 0 \.\. t"),
    (check_grouped_attention, grouped_mask_interleaved, r"the mask's rows must follow the queries' rows"),
    (check_grouped_attention, grouped_rows_by_position, r"the mask's rows must follow the queries' rows"),
    (check_grouped_attention, grouped_heads_back_swapped, r"put the heads back in their order"),
    (
        check_grouped_attention,
        grouped_not_grouped,
        r"raised ValueError: attention\(q, k, v, mask\) is chapter 03's multi-head attention[\s\S]*"
        r"hint: attention is multi-head: group the n_rep query heads",
    ),
    (check_grouped_attention, grouped_with_sdpa, r"ran torch's fused attention[\s\S]*enable_gqa=True included"),
    (check_grouped_attention, grouped_with_engine_attention, r"ran torch's fused attention[\s\S]*parts\.attention"),
    (check_grouped_attention, grouped_own_attention, r"did not call `attention`, the function it was given"),
    (check_grouped_attention, grouped_one_call_per_head, r"read \d+ key heads where there are \d+"),
    (check_grouped_attention, grouped_contiguous_kv, r"received a copy of k or v[\s\S]*no \.contiguous\(\)"),
    (check_grouped_attention, grouped_q_in_place, r"changed its input `q`[\s\S]*in-place operation"),
    (
        check_grouped_attention,
        grouped_q_view,
        r"view size is not compatible[\s\S]*q\.reshape\(B, H_kv, n_rep \* T, D\)",
    ),
    (
        check_grouped_attention,
        grouped_mask_untiled,
        r"mask=tensor bool \[2, 1, 6, 6\][\s\S]*one row per grouped query row",
    ),
    (check_grouped_attention, grouped_decode_kernel, r"cpu_kernels[\s\S]*black box[\s\S]*groups the query heads"),
    (check_rope_frequencies, rope_linear_multiplies, r'"linear" scaling \(Position Interpolation\) divides'),
    (check_rope_frequencies, rope_llama3_as_linear, r'"llama3" divides only the slow pairs'),
    (check_rope_frequencies, rope_bands_swapped, r"the bands are swapped"),
    (check_rope_frequencies, rope_smooth_wavelength_over_original, r"original divided by the wavelength"),
    (check_rope_frequencies, rope_blend_weights_swapped, r"the blend's weights"),
    (check_rope_frequencies, rope_blend_everywhere, r"the blend is for the pairs in between only"),
    (check_rope_frequencies, rope_wavelength_without_two_pi, r"wavelength is 2π / speed"),
    (check_rope_frequencies, rope_llama31_constants, r"original 4096[\s\S]*Llama 3\.1's 8192, 1 and 4"),
    (check_rope_frequencies, rope_theta_ignored, r"rope_theta 500 000[\s\S]*not 10 000"),
    (check_rope_frequencies, rope_exponent_i_over_d, r"2i / head_dim[\s\S]*not i / head_dim"),
    (check_rope_frequencies, rope_in_float32, r"computed in float32[\s\S]*compute in float64"),
    (check_rope_frequencies, rope_returns_float32, r"expected dtype torch\.float64, got torch\.float32[\s\S]*float64"),
    (check_rope_frequencies, rope_none_crashes, r"TypeError[\s\S]*treat None like"),
    (check_rope_frequencies, rope_default_needs_factor, r"KeyError: 'factor'[\s\S]*has no factor"),
    (check_rope_frequencies, rope_pops_the_kind, r"changed its input `rope_scaling`"),
    (check_rope_frequencies, rope_one_per_dimension, r"expected shape \(4,\), got \(8,\)[\s\S]*one speed per rotated"),
    (check_rope_frequencies, rope_engine_speeds, r"rope_inv_freq[\s\S]*black box"),
    (check_rms_norm, rms_layer_norm, r"that is LayerNorm"),
    (check_rms_norm, rms_eps_outside, r"eps goes inside the square root"),
    (
        check_rms_norm,
        rms_in_float16,
        r"float16, large values[\s\S]*computed in x's dtype, without the float32 cast[\s\S]*x\.float\(\) first",
    ),
    (check_rms_norm, rms_weight_before_cast, r"float16, large values[\s\S]*then multiply by weight"),
    (check_rms_norm, rms_one_plus_weight, r"Gemma"),
    (check_rms_norm, rms_sum_not_mean, r"root \*mean\* square"),
    (check_rms_norm, rms_returns_float32, r"expected dtype torch.float16, got torch.float32[\s\S]*float16 in"),
    (check_rms_norm, rms_with_view, r"non-contiguous view[\s\S]*view size[\s\S]*reshape"),
    (check_rms_norm, rms_fixed_eps, r"a large eps \(1\.0\)[\s\S]*the eps you are given"),
    (check_rms_norm, rms_with_f_rms_norm, r"black box this exercise opens"),
    (check_swiglu, swiglu_swapped, r"silu goes on the gate"),
    (check_swiglu, swiglu_glu, r"not sigmoid\(g\) alone"),
    (check_swiglu, swiglu_gelu, r"GeGLU"),
    (check_swiglu, swiglu_exp_sigmoid, r"large values ±1000[\s\S]*got nan[\s\S]*inf / inf"),
    (check_swiglu, swiglu_with_f_silu, r"F\.silu \(and nn\.SiLU\) is the black box"),
    (check_swiglu, swiglu_in_float32, r"expected dtype torch.float16, got torch.float32[\s\S]*float16 in"),
    (check_repeat_kv, repeat_tiled, r"n_rep 2[\s\S]*the KV heads tiled, 0, 1, 0, 1[\s\S]*repeat_interleave"),
    (check_repeat_kv, repeat_cat, r"the KV heads tiled, 0, 1, 0, 1[\s\S]*torch\.cat\(\[x\] \* n_rep, dim=1\)"),
    (check_repeat_kv, repeat_positions, r"not the positions"),
    (check_repeat_kv, repeat_with_view, r"non-contiguous view[\s\S]*view size[\s\S]*reshape"),
    (check_repeat_kv, repeat_expand_wrong_axis, r"the KV heads tiled[\s\S]*a new axis before the heads"),
    (check_qk_norm, qk_norm_over_heads, r"over head_dim \(the last dim, D features\), not over all the heads"),
    (check_qk_norm, qk_norm_one_weight, r"a weight each"),
    (check_qk_norm, qk_norm_q_only, r"normalize the keys too"),
    (check_qk_norm, qk_norm_swapped, r"return \(q, k\) in that order"),
    (check_qk_norm, qk_norm_in_half, r"without the float32 cast[\s\S]*x\.float\(\) first"),
    (check_llama_block, block_post_norm, r"Llama is pre-norm"),
    (check_llama_block, block_rope_before_norm, r"Qwen3[\s\S]*QK-norm comes before RoPE"),
    (check_llama_block, block_no_attention_residual, r"residual connection"),
    (check_llama_block, block_gelu_mlp, r"SwiGLU, not GPT-2's GELU MLP"),
    (check_llama_block, block_ignores_qk_norm, r"config\.qk_norm is true"),
    (check_llama_block, block_kv_with_n_head, r"config\.n_kv_head"),
    (check_llama_block, block_in_place, r"changed its input `x`[\s\S]*in-place operation"),
    (check_llama_block, block_repeats_kv_itself, r"no repeat_kv in the block"),
    (check_rms_norm, rms_remembers_eps, r"one argument changed"),
    (check_repeat_kv, repeat_remembers, r"one argument changed|n_rep comes from the call"),
    (check_llama_block, block_own_attention, r"decode steps after it are not[\s\S]*call attend"),
    (check_load_llama_checkpoint, load_tie_key_required, r"KeyError[\s\S]*absent|KeyError[\s\S]*leave tie_word"),
    (check_llama_block, block_weights_only, r"Qwen2[\s\S]*Qwen2's q, k and v have biases"),
    (check_llama_block, block_fixed_eps, r"rms_norm_eps 1e-3[\s\S]*config\.rms_norm_eps"),
    (check_load_llama_checkpoint, load_keeping_prefix, r"unexpected key 'model\.[\s\S]*drop the prefix 'model\.'"),
    (check_load_llama_checkpoint, load_always_tied, r"'lm_head\.weight' is missing[\s\S]*untied"),
    (check_load_llama_checkpoint, load_never_dropping_head, r"unexpected key 'lm_head\.weight'[\s\S]*tie_word_emb"),
    (check_load_llama_checkpoint, load_single_file, r"sharded checkpoint has no model\.safetensors"),
    (check_load_llama_checkpoint, load_first_shard, r"is missing[\s\S]*this checkpoint is sharded"),
    (check_load_llama_checkpoint, load_keeping_inv_freq, r"rotary_emb\.inv_freq'[\s\S]*RoPE's speeds"),
    (
        check_load_llama_checkpoint,
        load_to_float32,
        r"expected torch\.float16 \(as stored\)[\s\S]*the dtype the file stores",
    ),
    (check_load_llama_checkpoint, load_transposing, r"no transpose"),
    (check_rms_norm, rms_in_place_after_float, r"changed its input `x`[\s\S]*in-place operation"),
    (check_swiglu, swiglu_in_place, r"changed its input `up`[\s\S]*in-place operation"),
    (
        check_load_llama_checkpoint,
        load_every_safetensors,
        r"beside consolidated\.safetensors[\s\S]*unexpected key 'layers\.0\.attention\.[\s\S]*"
        r"hint: read the files the index lists \(its weight_map\), or model\.safetensors alone",
    ),
    (
        check_load_llama_checkpoint,
        load_index_else_every_safetensors,
        r"beside a LoRA adapter[\s\S]*unexpected key 'base_model\.[\s\S]*hint: read the files the index lists",
    ),
    (
        check_load_llama_checkpoint,
        load_every_shard_by_name,
        r"left over from an earlier save[\s\S]*the values of 'layers\.1\.[\s\S]*differ[\s\S]*"
        r"hint: read the files the index lists[\s\S]*\(model-00003-of-00003\.safetensors\)",
    ),
]


@pytest.mark.parametrize("check, wrong, message", MISTAKES, ids=[w.__name__ for _, w, _ in MISTAKES])
def test_mistake_is_rejected_with_a_specific_message(check, wrong, message):
    with pytest.raises(CheckFailed, match=message) as caught:
        check(wrong)
    text = str(caught.value)
    if not any(w in text for w in ("raised", "black box", "changed its input")):  # a wrong answer: input, expected, got
        assert "input:" in text and "expected:" in text and "got:" in text


@pytest.mark.parametrize(
    "check, wrong",
    [
        (check_repeat_kv, repeat_tiled),
        (check_repeat_kv, repeat_expand_wrong_axis),
        (check_rms_norm, rms_in_float16),
        (check_grouped_attention, grouped_heads_tiled),
        (check_grouped_attention, grouped_repeats_kv),
        (check_rope_frequencies, rope_bands_swapped),
    ],
    ids=[
        "repeat_tiled",
        "repeat_expand_wrong_axis",
        "rms_in_float16",
        "grouped_heads_tiled",
        "grouped_repeats_kv",
        "rope_bands_swapped",
    ],
)
def test_a_named_mistake_gets_one_hint(check, wrong):
    """The diagnosis alone: no case hint beside it that says the same (or, for rms_norm, the opposite)."""
    with pytest.raises(CheckFailed) as caught:
        check(wrong)
    assert str(caught.value).count("hint:") == 1


# -- correct, but written differently ----------------------------------------------------------------------------


def rms_norm_sum_and_sqrt(x, weight, eps):
    x32 = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    ms = (x32 * x32).sum(dim=-1, keepdim=True) / x.shape[-1]
    return weight * (x32 / torch.sqrt(ms + eps)).to(x.dtype)


def rms_norm_numpy(x, weight, eps):
    import numpy as np

    a = x.detach().double().numpy()
    normed = a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + eps)
    return weight * torch.from_numpy(normed).to(x.dtype)


def swiglu_one_over(gate, up):
    return gate / (1 + torch.exp(-gate)) * up


def repeat_kv_interleave(x, n_rep):
    return x.repeat_interleave(n_rep, dim=1)


def repeat_kv_index(x, n_rep):
    heads = torch.arange(x.shape[1] * n_rep) // n_rep  # query head h reads KV head h // n_rep
    return x[:, heads]


def qk_norm_written_out(q, k, q_weight, k_weight, eps):
    def norm(t, w):
        t32 = t.float()
        return w * (t32 / torch.sqrt(t32.square().mean(-1, keepdim=True) + eps)).to(t.dtype)

    return norm(q, q_weight), norm(k, k_weight)


def llama_block_own_attention(x, layer, config, rope, attend, parts):
    """Names spelled out, the MLP's pieces inline, the residual stream kept in a variable of its own."""
    eps = config.rms_norm_eps
    a, m = layer.self_attn, layer.mlp
    residual = x
    h = parts.rms_norm(x, layer.input_layernorm.weight, eps)
    B, T, _ = h.shape
    D = config.head_dim
    q = a.q_proj(h, parts.linear).view(B, T, config.n_head, D).transpose(1, 2)
    k = a.k_proj(h, parts.linear).view(B, T, config.n_kv_head, D).transpose(1, 2)
    v = a.v_proj(h, parts.linear).view(B, T, config.n_kv_head, D).transpose(1, 2)
    if config.qk_norm:
        q, k = parts.qk_norm(q, k, a.q_norm.weight, a.k_norm.weight, eps)
    out = attend(rope(q), rope(k), v).transpose(1, 2).reshape(B, T, config.n_head * D)
    residual = residual + a.o_proj(out, parts.linear)
    h = parts.rms_norm(residual, layer.post_attention_layernorm.weight, eps)
    gate = m.gate_proj(h, parts.linear)
    return residual + m.down_proj(gate * torch.sigmoid(gate) * m.up_proj(h, parts.linear), parts.linear)


def rms_in_place_on_a_copy(x, weight, eps):
    x32 = x.to(torch.float32, copy=True)  # a tensor of its own, whatever x's dtype
    x32 *= torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def swiglu_in_place_on_its_own_tensor(gate, up):
    out = torch.sigmoid(gate)
    out *= gate
    out *= up
    return out


def load_with_safe_open(folder):
    import re

    from safetensors import safe_open

    folder = Path(folder)
    with open(folder / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.load(open(index))["weight_map"].values())) if index.exists() else ["model.safetensors"]
    state = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                if re.search(r"rotary_emb\.inv_freq$", key):
                    continue
                if key == "lm_head.weight" and config.get("tie_word_embeddings"):
                    continue
                state[re.sub(r"^model\.", "", key)] = f.get_tensor(key)
    return state, config


def grouped_loop_over_groups(q, k, v, mask, attention):
    """One attention call per KV head, on views of k and v: each KV head still read once."""
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    m = causal_mask(T, Tk) if mask is None else mask.expand(B, H, T, Tk)
    outs = []
    for g in range(H_kv):
        rows = q[:, g * n_rep : (g + 1) * n_rep].reshape(B, 1, n_rep * T, D)
        mg = m.repeat(n_rep, 1) if mask is None else m[:, g * n_rep : (g + 1) * n_rep].reshape(B, 1, n_rep * T, Tk)
        outs.append(attention(rows, k[:, g : g + 1], v[:, g : g + 1], mg).view(B, n_rep, T, D))
    return torch.cat(outs, dim=1)


def grouped_rows_by_position_throughout(q, k, v, mask, attention):
    """The group's rows ordered by position (row t·n_rep + r), the mask and the output alike."""
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    rows = q.reshape(B, H_kv, n_rep, T, D).transpose(2, 3).reshape(B, H_kv, T * n_rep, D)
    if mask is None:
        m = causal_mask(T, Tk).repeat_interleave(n_rep, dim=0)
    else:
        m = mask.expand(B, H, T, Tk).reshape(B, H_kv, n_rep, T, Tk).transpose(2, 3).reshape(B, H_kv, T * n_rep, Tk)
    out = attention(rows, k, v, m)
    return out.view(B, H_kv, T, n_rep, D).transpose(2, 3).reshape(B, H, T, D)


def grouped_tril_and_contiguous_copy(q, k, v, mask, attention):
    """A contiguous copy of q viewed (q may be copied: only k and v must not be), the causal mask from tril."""
    B, H, T, D, H_kv, n_rep, Tk = _group(q, k)
    rows = q.contiguous().view(B, H_kv, n_rep * T, D)
    if mask is None:
        m = torch.ones(T, Tk, dtype=torch.bool).tril(diagonal=Tk - T).repeat(n_rep, 1)
    else:
        m = mask.expand(B, H, T, Tk).reshape(B, H_kv, n_rep * T, Tk)
    return attention(rows, k, v, m).view(B, H, T, D)


def rope_clamped_blend(head_dim, rope_theta, rope_scaling):
    """exp and log for the powers; llama3 as one blend with smooth clamped to [0, 1] (the bands' ends)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = torch.exp(-math.log(rope_theta) * 2 * i / head_dim)
    scaling = dict(rope_scaling or {})
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, original, low, high = _llama3_parts(scaling)
        turns = original * inv_freq / (2 * math.pi)  # original / wavelength
        smooth = ((turns - low) / (high - low)).clamp(0.0, 1.0)
        return inv_freq * ((1 - smooth) / factor + smooth)
    return inv_freq


def rope_python_floats(head_dim, rope_theta, rope_scaling):
    """A loop over the pairs in Python floats, the bands with <= and >= (equal at their edges: the blend meets them)."""
    scaling = rope_scaling if rope_scaling is not None else {"rope_type": "default"}
    speeds = []
    for i in range(head_dim // 2):
        speed = rope_theta ** (-2 * i / head_dim)
        if scaling["rope_type"] == "linear":
            speed = speed / scaling["factor"]
        elif scaling["rope_type"] == "llama3":
            factor, original, low, high = _llama3_parts(scaling)
            wavelength = 2 * math.pi / speed
            if wavelength >= original / low:
                speed = speed / factor
            elif wavelength > original / high:
                smooth = (original / wavelength - low) / (high - low)
                speed = (1 - smooth) * speed / factor + smooth * speed
        speeds.append(speed)
    return torch.tensor(speeds, dtype=torch.float64)


CORRECT = [
    (check_rms_norm, rms_norm_sum_and_sqrt),
    (check_rms_norm, rms_norm_numpy),
    (check_swiglu, swiglu_one_over),
    (check_repeat_kv, repeat_kv_interleave),
    (check_repeat_kv, repeat_kv_index),
    (check_grouped_attention, grouped_loop_over_groups),
    (check_grouped_attention, grouped_rows_by_position_throughout),
    (check_grouped_attention, grouped_tril_and_contiguous_copy),
    (check_rope_frequencies, rope_clamped_blend),
    (check_rope_frequencies, rope_python_floats),
    (check_qk_norm, qk_norm_written_out),
    (check_qk_norm, qk_norm_returns_list),
    (check_llama_block, llama_block_own_attention),
    (check_load_llama_checkpoint, load_with_safe_open),
    (check_rms_norm, rms_in_place_on_a_copy),
    (check_swiglu, swiglu_in_place_on_its_own_tensor),
]


@pytest.mark.parametrize("check, fn", CORRECT, ids=[f.__name__ for _, f in CORRECT])
def test_correct_but_different_passes(check, fn, capsys):
    check(fn)
    check(fn, seed=101)
    assert capsys.readouterr().out.count("✓") == 2


# -- the guards: a learner's part that breaks the engine's contract is named -------------------------------------


def test_guards_name_a_part_that_returns_the_wrong_shape_or_pair():
    model = tiny_llama(tiny_config(model_type="qwen3", qk_norm=True, head_dim=16))
    ids = torch.tensor([[1, 2, 3]])
    model.parts = guarded(Parts, grouped_attention=lambda q, k, v, mask, attention: attention(q[:, ::2], k, v, mask))
    with pytest.raises(PartError, match=r"part 'grouped_attention'[\s\S]*expected shape \(1, 4, 3, 16\)"):
        model(ids)  # one output per KV head, not per query head
    model.parts = guarded(Parts, rope_frequencies=lambda d, theta, s: rope_frequencies(d, theta, s).float())
    with pytest.raises(PartError, match=r"part 'rope_frequencies'[\s\S]*dtype torch\.float64"):
        model(ids)
    model.parts = guarded(Parts, qk_norm=lambda q, k, qw, kw, eps: rms_norm(q, qw, eps))  # one tensor, not a pair
    with pytest.raises(PartError, match=r"part 'qk_norm'[\s\S]*expected a pair \(q, k\)"):
        model(ids)
    model.parts = guarded(Parts, rms_norm=lambda x, w, eps: rms_norm(x.float(), w.float(), eps)[..., :-1])
    with pytest.raises(PartError, match=r"part 'rms_norm'[\s\S]*expected shape"):
        model(ids)
    model.parts = guarded(
        Parts,
        rms_norm=rms_norm,
        swiglu=swiglu,
        grouped_attention=grouped_attention,
        qk_norm=qk_norm,
        rope_frequencies=rope_frequencies,
    )
    with torch.no_grad():
        mine = model(ids)
        model.parts = Parts()
        assert torch.allclose(mine, model(ids), atol=1e-5)


def test_the_guard_names_a_loader_that_returns_what_the_engine_cannot_use(tmp_path):
    from llmcourse.checks.modern import checkpoint_folders
    from llmcourse.engine.loading import load_model

    (_, folder), *_ = checkpoint_folders(tmp_path)
    mine = load_model(folder, parts=guarded(Parts, load_llama_checkpoint=load_llama_checkpoint))
    with torch.no_grad():
        assert torch.equal(mine(torch.tensor([[1, 2, 3]])), load_model(folder)(torch.tensor([[1, 2, 3]])))
    for wrong, message in [
        (lambda folder: load_llama_checkpoint(folder)[0], r"expected a pair \(state_dict, config\)"),
        (lambda folder: ({"norm.weight": [1.0]}, {}), r"entry 'norm\.weight' is list; expected a tensor"),
        (lambda folder: (load_llama_checkpoint(folder)[0], "config.json"), r"expected config\.json read as a dict"),
    ]:
        with pytest.raises(PartError, match=r"part 'load_llama_checkpoint'[\s\S]*" + message):
            load_model(folder, parts=guarded(Parts, load_llama_checkpoint=wrong))
