"""Chapter 04's checks: the reference passes, stubs and plausible mistakes fail with a message that says
what is wrong, other correct ways of writing each exercise pass, black boxes are refused; and the
engine-side references agree with torch's and transformers' GPT-2."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import llmcourse
from llmcourse import GPT2Config
from llmcourse.checks import CheckFailed
from llmcourse.checks.gpt2 import (
    BLOCK_KEYS,
    block_weights,
    check_block,
    check_gelu,
    check_gpt2_forward,
    check_layer_norm,
    check_linear,
    check_load_gpt2_checkpoint,
    check_mlp,
    checkpoint_folders,
    hf_logits,
    lively_state_dict,
    reference_block,
    reference_checkpoint,
    reference_forward,
)
from llmcourse.engine import parts
from llmcourse.engine.parts import attention, causal_mask, embedding, merge_heads, split_heads

ROOT = Path(__file__).parents[1]
NOTEBOOK = ROOT / "solutions/04_gpt2/04_gpt2.ipynb"


# -- references, written as a learner would (they call only each other and the engine's chapter 02-03 parts)


def layer_norm(x, weight, bias, eps):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def linear(x, weight, bias):
    return x @ weight + bias


def mlp(x, c_fc_weight, c_fc_bias, c_proj_weight, c_proj_bias):
    return linear(gelu(linear(x, c_fc_weight, c_fc_bias)), c_proj_weight, c_proj_bias)


def attend(x, w, n_head, mask=True):
    B, T, C = x.shape
    q, k, v = (split_heads(t, n_head) for t in linear(x, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).split(C, -1))
    a = merge_heads(attention(q, k, v, causal_mask(T, T) if mask is True else mask))
    return linear(a, w["attn.c_proj.weight"], w["attn.c_proj.bias"])


def mlp_of(x, w):
    return mlp(x, w["mlp.c_fc.weight"], w["mlp.c_fc.bias"], w["mlp.c_proj.weight"], w["mlp.c_proj.bias"])


def block(x, weights, n_head, eps=1e-5):
    w = weights
    x = x + attend(layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return x + mlp_of(layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def n_layers(sd):
    return len({k.split(".")[1] for k in sd if k.startswith("h.")})


def gpt2_forward(state_dict, input_ids, n_head, eps=1e-5, *, blocks=None, head=None, final=True, positions=None):
    sd = state_dict
    B, T = input_ids.shape
    positions = torch.arange(T).expand(B, T) if positions is None else positions
    x = embedding(sd["wte.weight"], input_ids) + embedding(sd["wpe.weight"], positions)
    for i in blocks if blocks is not None else range(n_layers(sd)):
        x = block(x, {k: sd[f"h.{i}.{k}"] for k in BLOCK_KEYS}, n_head, eps)
    if final:
        x = layer_norm(x, sd["ln_f.weight"], sd["ln_f.bias"], eps)
    return x @ (sd["wte.weight"] if head is None else head).T


def load_gpt2_checkpoint(folder):
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    state_dict = {}
    for key, tensor in load_file(folder / "model.safetensors").items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or key.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        state_dict[key] = tensor.float()
    return state_dict, config


REFERENCES = [
    (check_layer_norm, layer_norm, dict(n_random=40)),
    (check_gelu, gelu, dict(n_random=40)),
    (check_linear, linear, dict(n_random=40)),
    (check_mlp, mlp, dict(n_random=10)),
    (check_block, block, dict(n_random=10)),
    (check_gpt2_forward, gpt2_forward, dict(n_random=4)),
    (check_load_gpt2_checkpoint, load_gpt2_checkpoint, dict()),
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


# -- plausible mistakes, each rejected with a message that names it -------------------------------


def layer_norm_unbiased(x, weight, bias, eps):
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + eps) * weight + bias


def layer_norm_std_unbiased(x, weight, bias, eps):
    return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + eps) * weight + bias


def layer_norm_eps_outside(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / (((x - mean) ** 2).mean(-1, keepdim=True).sqrt() + eps) * weight + bias


def layer_norm_dim1(x, weight, bias, eps):
    mean = x.mean(1, keepdim=True)  # right for [T, C], wrong once there is a batch dimension
    var = ((x - mean) ** 2).mean(1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def layer_norm_no_bias(x, weight, bias, eps):
    return layer_norm(x, weight, 0, eps)


def layer_norm_one_pass(x, weight, bias, eps):
    var = (x**2).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + eps) * weight + bias


def layer_norm_in_float32(x, weight, bias, eps):
    return layer_norm(x.float(), weight.float(), bias.float(), eps)


def layer_norm_float32_inside(x, weight, bias, eps):
    return layer_norm(x.float(), weight.float(), bias.float(), eps).to(x.dtype)  # float64 only in name


def gelu_erf(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_sigmoid(x):
    return x * torch.sigmoid(1.702 * x)


def gelu_no_half(x):
    return x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_typo(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.44715 * x**3)))


def gelu_tanh_by_exp(x):
    z = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
    return 0.5 * x * (1 + (torch.exp(2 * z) - 1) / (torch.exp(2 * z) + 1))  # inf / inf for large x


def gelu_float32_constant(x):
    c = torch.tensor(math.sqrt(2 / math.pi))  # a float32 constant: float64 inputs lose precision
    return (0.5 * x * (1 + torch.tanh(c * (x + 0.044715 * x**3)))).to(x.dtype)


def gelu_in_float32(x):
    return gelu(x.float()).to(x.dtype)


def linear_transposed(x, weight, bias):
    return x @ weight.T + bias


def linear_with_f_linear_untransposed(x, weight, bias):
    return F.linear(x, weight, bias)  # nn.Linear's layout: [C_out, C_in]


def linear_bias_first(x, weight, bias):
    return (x + bias) @ weight


def linear_3d_only(x, weight, bias):
    B, T, C = x.shape  # right for [B, T, C] only
    return (x.reshape(B * T, C) @ weight + bias).reshape(B, T, -1)


def linear_float32(x, weight, bias):
    return x.float() @ weight.float() + bias.float()


def mlp_gelu_last(x, w1, b1, w2, b2):
    return gelu(linear(linear(x, w1, b1), w2, b2))


def mlp_relu(x, w1, b1, w2, b2):
    return linear(torch.relu(linear(x, w1, b1)), w2, b2)


def mlp_erf(x, w1, b1, w2, b2):
    return linear(gelu_erf(linear(x, w1, b1)), w2, b2)


def mlp_no_bias(x, w1, b1, w2, b2):
    return gelu(x @ w1) @ w2


def block_post_ln(x, w, n_head, eps=1e-5):
    x = layer_norm(x + attend(x, w, n_head), w["ln_1.weight"], w["ln_1.bias"], eps)
    return layer_norm(x + mlp_of(x, w), w["ln_2.weight"], w["ln_2.bias"], eps)


def block_one_residual(x, w, n_head, eps=1e-5):
    h = attend(layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return x + mlp_of(layer_norm(h, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def block_ln2_on_input(x, w, n_head, eps=1e-5):
    a = x + attend(layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    return a + mlp_of(layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def block_not_causal(x, w, n_head, eps=1e-5):
    T = x.shape[1]
    x = x + attend(
        layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head, mask=torch.ones(T, T, dtype=torch.bool)
    )
    return x + mlp_of(layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def block_heads_mixed_up(x, w, n_head, eps=1e-5):
    """Splits the heads with a plain view (no transpose): right for one head, wrong for several."""
    h = layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps)
    B, T, C = h.shape
    q, k, v = (
        t.reshape(B, n_head, T, C // n_head)
        for t in linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).split(C, -1)
    )
    a = attention(q, k, v, causal_mask(T, T)).reshape(B, T, C)
    x = x + linear(a, w["attn.c_proj.weight"], w["attn.c_proj.bias"])
    return x + mlp_of(layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def forward_without_ln_f(sd, ids, n_head, eps=1e-5):
    return gpt2_forward(sd, ids, n_head, eps, final=False)


def forward_without_positions(sd, ids, n_head, eps=1e-5):
    B, T = ids.shape
    x = embedding(sd["wte.weight"], ids)
    for i in range(n_layers(sd)):
        x = block(x, {k: sd[f"h.{i}.{k}"] for k in BLOCK_KEYS}, n_head, eps)
    return layer_norm(x, sd["ln_f.weight"], sd["ln_f.bias"], eps) @ sd["wte.weight"].T


def forward_untied(sd, ids, n_head, eps=1e-5):
    g = torch.Generator().manual_seed(12345)
    head = torch.randn(sd["wte.weight"].shape, generator=g, dtype=sd["wte.weight"].dtype) * 0.02  # a new lm_head
    return gpt2_forward(sd, ids, n_head, eps, head=head)


def forward_string_order(sd, ids, n_head, eps=1e-5):
    layers = sorted({k.split(".")[1] for k in sd if k.startswith("h.")})  # '0', '1', '10', '11', '2', ...
    return gpt2_forward(sd, ids, n_head, eps, blocks=layers)


def forward_positions_over_the_batch(sd, ids, n_head, eps=1e-5):
    B, T = ids.shape
    positions = torch.arange(B * T).view(B, T) % sd["wpe.weight"].shape[0]  # counts on across the rows
    return gpt2_forward(sd, ids, n_head, eps, positions=positions)


def load_transposing(folder):
    sd, config = load_gpt2_checkpoint(folder)
    return {k: v.T.contiguous() if v.dim() == 2 and ".c_" in k else v for k, v in sd.items()}, config


def load_transposing_square_only(folder):
    sd, config = load_gpt2_checkpoint(folder)
    return {k: v.T.contiguous() if v.dim() == 2 and v.shape[0] == v.shape[1] else v for k, v in sd.items()}, config


def load_keeping_prefix(folder):
    config = json.loads((Path(folder) / "config.json").read_text())
    return {k: v for k, v in load_file(Path(folder) / "model.safetensors").items() if k != "lm_head.weight"}, config


def load_keeping_buffers(folder):
    config = json.loads((Path(folder) / "config.json").read_text())
    sd = {k.removeprefix("transformer."): v for k, v in load_file(Path(folder) / "model.safetensors").items()}
    sd.pop("lm_head.weight", None)
    return sd, config


def load_keeping_lm_head(folder):
    config = json.loads((Path(folder) / "config.json").read_text())
    sd = {k.removeprefix("transformer."): v for k, v in load_file(Path(folder) / "model.safetensors").items()}
    return {k: v for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}, config


def load_dropping_c_attn_bias(folder):
    sd, config = load_keeping_lm_head(folder)
    return {k: v for k, v in sd.items() if not k.endswith(("attn.bias", "lm_head.weight"))}, config  # c_attn.bias too


def load_keeping_float16(folder):
    folder = Path(folder)
    sd = {k.removeprefix("transformer."): v for k, v in load_file(folder / "model.safetensors").items()}
    sd = {k: v for k, v in sd.items() if k != "lm_head.weight" and not k.endswith((".attn.bias", ".attn.masked_bias"))}
    return sd, json.loads((folder / "config.json").read_text())


def load_config_object(folder):
    sd, _ = load_gpt2_checkpoint(folder)
    return sd, GPT2Config.from_json(Path(folder) / "config.json")


def load_str_only(folder):
    if not isinstance(folder, str):
        raise TypeError(f"unsupported operand type(s) for +: '{type(folder).__name__}' and 'str'")
    return load_gpt2_checkpoint(folder)


# kinds of issue 22: dtypes, layouts, shapes, parameters, defaults, sizes


def layer_norm_view(x, weight, bias, eps):
    C = x.shape[-1]
    return layer_norm(x.view(-1, C), weight, bias, eps).view(x.shape)  # fails on a non-contiguous x


def layer_norm_half_to_float(x, weight, bias, eps):
    return (
        layer_norm(x.float(), weight.float(), bias.float(), eps)
        if x.dtype in (torch.float16, torch.bfloat16)
        else layer_norm(x, weight, bias, eps)
    )  # float16 in, float32 out


def layer_norm_fixed_eps(x, weight, bias, eps):
    return layer_norm(x, weight, bias, 1e-5)


def gelu_view(x):
    return gelu(x.view(-1)).view(x.shape)


def gelu_half_to_float(x):
    return gelu(x.float()) if x.dtype in (torch.float16, torch.bfloat16) else gelu(x)


def gelu_loop_over_rows(x):
    return torch.stack([gelu(row) for row in x]) if x.dim() > 1 else gelu(x)[:4]  # drops values of long 1-D inputs


def linear_view(x, weight, bias):
    return (x.view(-1, x.shape[-1]) @ weight + bias).view(*x.shape[:-1], -1)


def linear_addmm_2d(x, weight, bias):
    return (
        torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], -1)
        if x.dim() > 1
        else torch.addmm(bias, x, weight)
    )  # 1-D x: addmm wants a matrix


def linear_half_to_float(x, weight, bias):
    return (
        x.float() @ weight.float() + bias.float()
        if x.dtype in (torch.float16, torch.bfloat16)
        else linear(x, weight, bias)
    )


def mlp_3d_only(x, w1, b1, w2, b2):
    B, T, C = x.shape
    return mlp(x, w1, b1, w2, b2)


def mlp_view(x, w1, b1, w2, b2):
    C = x.shape[-1]
    return mlp(x.view(-1, C), w1, b1, w2, b2).view(x.shape)


def mlp_half_to_float(x, w1, b1, w2, b2):
    if x.dtype in (torch.float16, torch.bfloat16):
        return mlp(x.float(), w1.float(), b1.float(), w2.float(), b2.float())
    return mlp(x, w1, b1, w2, b2)


def block_fixed_eps(x, weights, n_head, eps=1e-5):
    return block(x, weights, n_head)  # eps not passed on


def block_wrong_default(x, weights, n_head, eps=1e-6):
    return block(x, weights, n_head, eps)


def block_half_to_float(x, weights, n_head, eps=1e-5):
    if x.dtype in (torch.float16, torch.bfloat16):
        return block(x.float(), {k: v.float() for k, v in weights.items()}, n_head, eps)
    return block(x, weights, n_head, eps)


def forward_ln_f_without_affine(sd, ids, n_head, eps=1e-5):
    sd = {**sd, "ln_f.weight": torch.ones_like(sd["ln_f.weight"]), "ln_f.bias": torch.zeros_like(sd["ln_f.bias"])}
    return gpt2_forward(sd, ids, n_head, eps)


def forward_single_digit_layers(sd, ids, n_head, eps=1e-5):
    import re

    layers = sorted({int(m.group(1)) for k in sd if (m := re.match(r"h\.(\d)\.", k))})  # h.10 does not match
    return gpt2_forward(sd, ids, n_head, eps, blocks=layers)


def forward_fixed_eps(sd, ids, n_head, eps=1e-5):
    return gpt2_forward(sd, ids, n_head)


def forward_float32(sd, ids, n_head, eps=1e-5):
    if sd["wte.weight"].dtype in (torch.float16, torch.bfloat16):
        sd = {k: v.float() for k, v in sd.items()}
    return gpt2_forward(sd, ids, n_head, eps)


def forward_wrong_default(sd, ids, n_head, eps=1e-6):
    return gpt2_forward(sd, ids, n_head, eps)


def load_regex_single_digit(folder):
    import re

    sd, config = load_gpt2_checkpoint(folder)
    return {k: v for k, v in sd.items() if not k.startswith("h.") or re.match(r"h\.\d\.", k)}, config


def load_half_only(folder):
    folder = Path(folder)
    sd = {}
    for key, tensor in load_file(folder / "model.safetensors").items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or key.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        sd[key] = tensor.float() if tensor.dtype == torch.float16 else tensor  # bfloat16 and float64 stay
    return sd, json.loads((folder / "config.json").read_text())


def load_buffers_by_single_digit(folder):
    import re

    folder = Path(folder)
    sd = {}
    for key, tensor in load_file(folder / "model.safetensors").items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or re.fullmatch(r"h\.\d\.attn\.(bias|masked_bias)", key):
            continue
        sd[key] = tensor.float()
    return sd, json.loads((folder / "config.json").read_text())


def layer_norm_sum_then_divide(x, weight, bias, eps):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).sum(dim=-1, keepdim=True) / x.shape[-1]  # the sum overflows float16 before / C
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu_tanh_by_clamped_exp(x):
    z = (math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)).clamp(-20, 20)  # e^40 fits in float32, not in float16
    return 0.5 * x * (1 + (torch.exp(2 * z) - 1) / (torch.exp(2 * z) + 1))


def layer_norm_in_place_after_float(x, weight, bias, eps):
    x = x.float()  # for a float32 x, x.float() is x itself: the in-place steps below change the caller's tensor
    x -= x.mean(dim=-1, keepdim=True)
    x /= torch.sqrt((x**2).mean(dim=-1, keepdim=True) + eps)
    return x * weight + bias


def block_adding_in_place(x, w, n_head, eps=1e-5):
    x += attend(layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)  # the caller's x
    x += mlp_of(layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)
    return x


def forward_adding_lm_head(sd, ids, n_head, eps=1e-5):
    head = sd.setdefault("lm_head.weight", sd["wte.weight"])  # the tied head, written into the caller's dict
    return gpt2_forward(sd, ids, n_head, eps, head=head)


def _load_files(folder, files):
    """A GPT-2 state dict (the engine's names, float32) and config.json, from these safetensors files in order."""
    sd = {}
    for file in files:
        for key, tensor in load_file(file).items():
            key = key.removeprefix("transformer.")
            if key != "lm_head.weight" and not key.endswith((".attn.bias", ".attn.masked_bias")):
                sd[key] = tensor.float()
    return sd, json.loads((Path(folder) / "config.json").read_text())


def load_every_safetensors(folder):
    return _load_files(folder, sorted(Path(folder).glob("*.safetensors")))  # adapters and optimizers too


def load_first_safetensors(folder):
    return _load_files(folder, sorted(Path(folder).glob("*.safetensors"))[:1])  # adapter_model sorts first


def load_every_safetensors_keeping_gpt2_names(folder):
    sd, config = load_every_safetensors(folder)
    names = ("wte.", "wpe.", "h.", "ln_f.")
    return {k: v for k, v in sd.items() if k.startswith(names)}, config  # optimizer.safetensors overwrites them


MISTAKES = [
    (check_layer_norm, layer_norm_unbiased, r"biased variance[\s\S]*unbiased=False"),
    (check_layer_norm, layer_norm_std_unbiased, r"biased variance|eps goes inside"),
    (check_layer_norm, layer_norm_eps_outside, r"eps goes inside the square root"),
    (check_layer_norm, layer_norm_dim1, r"a batch of 2 sequences[\s\S]*normalize over the last dimension"),
    (check_layer_norm, layer_norm_no_bias, r"weight and bias[\s\S]*x̂ \* weight \+ bias"),
    (check_layer_norm, layer_norm_one_pass, r"around 1000[\s\S]*subtract the mean first"),
    (check_layer_norm, layer_norm_in_float32, r"float64[\s\S]*expected dtype torch.float64, got torch.float32"),
    (check_layer_norm, layer_norm_float32_inside, r"float64, values around 1000[\s\S]*the values differ"),
    (check_gelu, gelu_erf, r"erf[\s\S]*tanh approximation"),
    (check_gelu, gelu_sigmoid, r"sigmoid approximation"),
    (check_gelu, gelu_no_half, r"starts with 0\.5·x"),
    (check_gelu, gelu_typo, r"0\.044715 \(not 0\.44715\)"),
    (check_gelu, gelu_tanh_by_exp, r"large values ±20[\s\S]*got nan[\s\S]*e\^600 overflows"),
    (check_gelu, gelu_float32_constant, r"float64, -6 to 6[\s\S]*the values differ"),
    (check_gelu, gelu_in_float32, r"float64, -6 to 6[\s\S]*the values differ"),
    (check_linear, linear_transposed, r"cannot be multiplied[\s\S]*\[C_in, C_out\][\s\S]*no transpose"),
    (check_linear, linear_with_f_linear_untransposed, r"raised RuntimeError|square weight[\s\S]*no transpose"),
    (check_linear, linear_bias_first, r"(raised RuntimeError|square weight[\s\S]*multiply first)"),
    (check_linear, linear_3d_only, r"not enough values to unpack[\s\S]*any number of leading dimensions"),
    (check_linear, linear_float32, r"float64[\s\S]*expected dtype torch.float64, got torch.float32"),
    (check_mlp, mlp_gelu_last, r"between the two layers"),
    (check_mlp, mlp_relu, r"not ReLU"),
    (check_mlp, mlp_erf, r"not the erf form"),
    (check_mlp, mlp_no_bias, r"both layers have a bias"),
    (check_block, block_post_ln, r"pre-LN"),
    (check_block, block_one_residual, r"each sub-layer adds to the residual stream"),
    (check_block, block_ln2_on_input, r"ln_2 normalizes the stream \*after\*"),
    (check_block, block_not_causal, r"x \[1, 4, 8\][\s\S]*must be causal"),
    (check_block, block_heads_mixed_up, r"x \[1, 4, 8\], 2 heads[\s\S]*mixes positions and heads"),
    (check_gpt2_forward, forward_without_ln_f, r"final layer norm ln_f"),
    (check_gpt2_forward, forward_without_positions, r"add the position embeddings"),
    (check_gpt2_forward, forward_untied, r"tied head[\s\S]*no separate lm_head"),
    (check_gpt2_forward, forward_string_order, r"12 layers[\s\S]*h\.10 before h\.2"),
    (check_gpt2_forward, forward_positions_over_the_batch, r"batch of 3[\s\S]*first sequence is right"),
    (check_load_gpt2_checkpoint, load_transposing, r"has shape \(24, 8\), expected \(8, 24\)[\s\S]*no transpose"),
    (
        check_load_gpt2_checkpoint,
        load_transposing_square_only,
        r"values of 'h\.0\.attn\.c_proj\.weight'[\s\S]*no transpose",
    ),
    (check_load_gpt2_checkpoint, load_keeping_prefix, r"unexpected key 'transformer\.[\s\S]*drop the prefix"),
    (check_load_gpt2_checkpoint, load_keeping_buffers, r"unexpected key 'h\.0\.attn\.bias'[\s\S]*buffers"),
    (check_load_gpt2_checkpoint, load_keeping_lm_head, r"unexpected key 'lm_head\.weight'[\s\S]*tied"),
    (check_load_gpt2_checkpoint, load_dropping_c_attn_bias, r"the key 'h\.0\.attn\.c_attn\.bias' is missing"),
    (
        check_load_gpt2_checkpoint,
        load_keeping_float16,
        r"float16[\s\S]*has dtype torch.float16, expected torch.float32[\s\S]*\.float\(\)",
    ),
    (check_load_gpt2_checkpoint, load_config_object, r"the config should be the dict read from config\.json"),
    (check_load_gpt2_checkpoint, load_str_only, r"raised TypeError"),
    (check_layer_norm, layer_norm_view, r"non-contiguous view[\s\S]*raised RuntimeError: view size[\s\S]*reshape"),
    (
        check_layer_norm,
        layer_norm_half_to_float,
        r"float16[\s\S]*expected dtype torch.float16, got torch.float32[\s\S]*float16 in, float16 out",
    ),
    (check_layer_norm, layer_norm_fixed_eps, r"eps"),
    (check_gelu, gelu_view, r"raised RuntimeError: view size[\s\S]*non-contiguous view[\s\S]*reshape"),
    (
        check_gelu,
        gelu_half_to_float,
        r"float16[\s\S]*expected dtype torch.float16, got torch.float32[\s\S]*float16 in, float16 out",
    ),
    (check_gelu, gelu_loop_over_rows, r"a few values[^:]*: expected shape \(\d+,\), got \(4,\)"),
    (check_linear, linear_view, r"non-contiguous view[\s\S]*raised RuntimeError: view size[\s\S]*reshape"),
    (check_linear, linear_addmm_2d, r"linear\(x=tensor float32 \[4\][\s\S]*raised RuntimeError[\s\S]*none too"),
    (
        check_linear,
        linear_half_to_float,
        r"float16[\s\S]*expected dtype torch.float16, got torch.float32[\s\S]*float16 in, float16 out",
    ),
    (
        check_mlp,
        mlp_3d_only,
        r"mlp\(x=tensor float32 \[8\][\s\S]*values to unpack[\s\S]*any number of leading dimensions",
    ),
    (check_mlp, mlp_view, r"non-contiguous view[\s\S]*raised RuntimeError: view size[\s\S]*reshape"),
    (
        check_mlp,
        mlp_half_to_float,
        r"float16[\s\S]*expected dtype torch.float16, got torch.float32[\s\S]*float16 in, float16 out",
    ),
    (check_block, block_fixed_eps, r"eps = 0\.1[\s\S]*pass eps to both layer norms"),
    (check_block, block_wrong_default, r"without eps[\s\S]*default is GPT-2's layer_norm_epsilon, 1e-5"),
    (
        check_block,
        block_half_to_float,
        r"float16[\s\S]*expected dtype torch.float16, got torch.float32[\s\S]*float16 in, float16 out",
    ),
    (check_gpt2_forward, forward_ln_f_without_affine, r"ln_f has a weight and a bias too"),
    (check_gpt2_forward, forward_single_digit_layers, r"12 layers[\s\S]*h\.10 and h\.11 too"),
    (check_gpt2_forward, forward_fixed_eps, r"eps = 1e-3[\s\S]*pass eps to every layer norm"),
    (check_gpt2_forward, forward_float32, r"float16 weights[\s\S]*expected dtype torch.float16, got torch.float32"),
    (check_gpt2_forward, forward_wrong_default, r"without eps[\s\S]*default is GPT-2's layer_norm_epsilon, 1e-5"),
    (
        check_load_gpt2_checkpoint,
        load_regex_single_digit,
        r"12 layers[\s\S]*'h\.10\.[\s\S]* is missing[\s\S]*two digits",
    ),
    (check_load_gpt2_checkpoint, load_half_only, r"bfloat16[\s\S]*has dtype torch.bfloat16, expected torch.float32"),
    (
        check_load_gpt2_checkpoint,
        load_buffers_by_single_digit,
        r"12 layers[\s\S]*unexpected key 'h\.10\.attn\.bias'[\s\S]*buffers",
    ),
    (check_layer_norm, layer_norm_sum_then_divide, r"float16, values 300 ± 40[\s\S]*sum of the C squares overflows"),
    (check_gelu, gelu_tanh_by_clamped_exp, r"float16[\s\S]*got nan[\s\S]*tanh written with exp overflows in float16"),
    (check_layer_norm, layer_norm_in_place_after_float, r"changed its input `x`[\s\S]*in-place operation"),
    (check_block, block_adding_in_place, r"changed its input `x`[\s\S]*in-place operation"),
    (
        check_gpt2_forward,
        forward_adding_lm_head,
        r"changed its input `sd`[\s\S]*had no key 'lm_head\.weight'[\s\S]*copy it first",
    ),
    (
        check_load_gpt2_checkpoint,
        load_every_safetensors,
        r"beside a LoRA adapter[\s\S]*unexpected key 'base_model\.[\s\S]*"
        r"hint: read the files the index lists \(its weight_map\), or model\.safetensors alone",
    ),
    (
        check_load_gpt2_checkpoint,
        load_first_safetensors,
        r"adapter_model\.safetensors[\s\S]*hint: read the files the index lists[\s\S]*nor the first one",
    ),
    (
        check_load_gpt2_checkpoint,
        load_every_safetensors_keeping_gpt2_names,
        r"beside optimizer\.safetensors[\s\S]*the values of '[\s\S]*differ[\s\S]*hint: read the files the index "
        r"lists[\s\S]*\(optimizer\.safetensors\)",
    ),
]


@pytest.mark.parametrize("check, wrong, message", MISTAKES, ids=[w.__name__ for _, w, _ in MISTAKES])
def test_mistake_is_rejected_with_a_specific_message(check, wrong, message):
    with pytest.raises(CheckFailed, match=message) as caught:
        check(wrong)
    text = str(caught.value)
    if not any(w in text for w in ("raised", "changed its input")):  # a wrong answer: input, expected and got
        assert "input:" in text and "expected:" in text and "got:" in text


# -- correct, but written differently -----------------------------------------------------------


def layer_norm_with_var(x, weight, bias, eps):
    return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + eps) * weight + bias


def layer_norm_with_var_mean(x, weight, bias, eps):
    var, mean = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
    return weight * (x - mean) / (var + eps).sqrt() + bias


def gelu_with_sigmoid_identity(x):
    # 0.5 (1 + tanh(z)) = sigmoid(2z)
    return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3)))


def gelu_transformers_style(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def linear_with_f_linear(x, weight, bias):
    return F.linear(x, weight.T, bias)


def linear_with_addmm(x, weight, bias):
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[1])


def linear_with_einsum(x, weight, bias):
    return torch.einsum("...i,io->...o", x, weight) + bias


def mlp_in_one_line(x, w1, b1, w2, b2):
    return gelu_with_sigmoid_identity(x @ w1 + b1) @ w2 + b2


def block_with_fused_heads(x, w, n_head, eps=1e-5):
    """Attention written out without split_heads / attention (one view and permute)."""
    B, T, C = x.shape
    h = layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps)
    qkv = linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).view(B, T, 3, n_head, C // n_head)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, T, D]
    scores = q @ k.transpose(-2, -1) / math.sqrt(C // n_head)
    scores = scores.masked_fill(~causal_mask(T, T), float("-inf"))
    a = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, C)
    x = x + linear(a, w["attn.c_proj.weight"], w["attn.c_proj.bias"])
    return x + mlp_of(layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)


def forward_with_wte_indexing(sd, ids, n_head, eps=1e-5):
    T = ids.shape[1]
    x = sd["wte.weight"][ids] + sd["wpe.weight"][:T]
    i = 0
    while f"h.{i}.ln_1.weight" in sd:
        x = block_with_fused_heads(
            x, {k.removeprefix(f"h.{i}."): v for k, v in sd.items() if k.startswith(f"h.{i}.")}, n_head, eps
        )
        i += 1
    return linear(
        layer_norm(x, sd["ln_f.weight"], sd["ln_f.bias"], eps),
        sd["wte.weight"].T,
        torch.zeros(sd["wte.weight"].shape[0], dtype=x.dtype),
    )


def load_with_safe_open(folder):
    import re

    from safetensors import safe_open

    folder = Path(folder)
    with open(folder / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    sd = {}
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            name = re.sub(r"^transformer\.", "", key)
            if re.fullmatch(r"h\.\d+\.attn\.(bias|masked_bias)|lm_head\.weight", name):
                continue
            sd[name] = f.get_tensor(key).to(torch.float32)
    return sd, config


def layer_norm_welford(x, weight, bias, eps):
    """Welford's running mean and variance, one feature at a time (in x's dtype, float32 for half)."""
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = torch.zeros(work.shape[:-1], dtype=work.dtype)
    m2 = torch.zeros_like(mean)
    for k in range(work.shape[-1]):
        delta = work[..., k] - mean
        mean = mean + delta / (k + 1)
        m2 = m2 + delta * (work[..., k] - mean)
    var = m2 / work.shape[-1]
    out = (work - mean[..., None]) / torch.sqrt(var[..., None] + eps) * weight.to(work.dtype) + bias.to(work.dtype)
    return out.to(x.dtype)


def layer_norm_float64_numpy(x, weight, bias, eps):
    """In float64 with numpy, the answer converted back to x's dtype."""
    import numpy as np

    a = x.detach().double().numpy()
    mean = a.mean(-1, keepdims=True)
    var = np.square(a - mean).mean(-1, keepdims=True)
    out = (a - mean) / np.sqrt(var + np.float64(eps)) * weight.double().numpy() + bias.double().numpy()
    return torch.from_numpy(out).to(x.dtype)


def gelu_float64_numpy(x):
    import numpy as np

    a = x.detach().double().numpy()
    return torch.from_numpy(0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))).to(x.dtype)


def linear_float32_accumulation(x, weight, bias):
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x.to(wide) @ weight.to(wide) + bias.to(wide)).to(x.dtype)


def mlp_float64(x, w1, b1, w2, b2):
    return mlp(x.double(), w1.double(), b1.double(), w2.double(), b2.double()).to(x.dtype)


def block_welford(x, weights, n_head, eps=1e-5):
    w = weights
    B, T, C = x.shape
    h = layer_norm_welford(x, w["ln_1.weight"], w["ln_1.bias"], eps)
    q, k, v = (split_heads(t, n_head) for t in linear(h, w["attn.c_attn.weight"], w["attn.c_attn.bias"]).split(C, -1))
    x = x + linear(merge_heads(attention(q, k, v, causal_mask(T, T))), w["attn.c_proj.weight"], w["attn.c_proj.bias"])
    return x + mlp(
        layer_norm_welford(x, w["ln_2.weight"], w["ln_2.bias"], eps),
        w["mlp.c_fc.weight"],
        w["mlp.c_fc.bias"],
        w["mlp.c_proj.weight"],
        w["mlp.c_proj.bias"],
    )


def forward_in_float64(sd, ids, n_head, eps=1e-5):
    dtype = sd["wte.weight"].dtype
    return gpt2_forward({k: v.double() for k, v in sd.items()}, ids, n_head, eps).to(dtype)


def load_in_sorted_order(folder):
    sd, config = load_gpt2_checkpoint(folder)
    return {k: v.to(torch.float32) for k, v in sorted(sd.items())}, config


def layer_norm_in_place_on_a_copy(x, weight, bias, eps):
    x = x.clone()  # a tensor of its own: in-place steps are fine
    x -= x.mean(dim=-1, keepdim=True)
    x /= torch.sqrt((x**2).mean(dim=-1, keepdim=True) + eps)
    return x * weight + bias


def block_adding_in_place_to_a_copy(x, w, n_head, eps=1e-5):
    x = x.clone()
    x += attend(layer_norm(x, w["ln_1.weight"], w["ln_1.bias"], eps), w, n_head)
    x += mlp_of(layer_norm(x, w["ln_2.weight"], w["ln_2.bias"], eps), w)
    return x


def forward_reading_lm_head(sd, ids, n_head, eps=1e-5):
    return gpt2_forward(sd, ids, n_head, eps, head=sd.get("lm_head.weight", sd["wte.weight"]))


def load_by_the_index(folder):
    """The engine's rule: model.safetensors, else every shard model.safetensors.index.json lists (once each)."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return _load_files(folder, [folder / "model.safetensors"])
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return _load_files(folder, [folder / name for name in dict.fromkeys(index["weight_map"].values())])


ALTERNATIVES = [
    (check_layer_norm, layer_norm_with_var),
    (check_layer_norm, layer_norm_with_var_mean),
    (check_gelu, gelu_with_sigmoid_identity),
    (check_gelu, gelu_transformers_style),
    (check_linear, linear_with_f_linear),
    (check_linear, linear_with_addmm),
    (check_linear, linear_with_einsum),
    (check_mlp, mlp_in_one_line),
    (check_block, block_with_fused_heads),
    (check_gpt2_forward, forward_with_wte_indexing),
    (check_load_gpt2_checkpoint, load_with_safe_open),
    (check_layer_norm, layer_norm_welford),
    (check_layer_norm, layer_norm_float64_numpy),
    (check_gelu, gelu_float64_numpy),
    (check_linear, linear_float32_accumulation),
    (check_mlp, mlp_float64),
    (check_block, block_welford),
    (check_gpt2_forward, forward_in_float64),
    (check_load_gpt2_checkpoint, load_in_sorted_order),
    (check_load_gpt2_checkpoint, load_by_the_index),
    (check_layer_norm, layer_norm_in_place_on_a_copy),
    (check_block, block_adding_in_place_to_a_copy),
    (check_gpt2_forward, forward_reading_lm_head),
]


@pytest.mark.parametrize("check, alternative", ALTERNATIVES, ids=[a.__name__ for _, a in ALTERNATIVES])
def test_correct_alternative_passes(check, alternative, capsys):
    check(alternative)
    check(alternative, seed=7)
    assert capsys.readouterr().out.count("✓") == 2


# -- black boxes, however they are reached ------------------------------------------------------


class LayerNormModule(torch.nn.LayerNorm):
    pass


BLACK_BOXES = [
    (check_layer_norm, lambda x, w, b, eps: F.layer_norm(x, x.shape[-1:], w, b, eps), r"called torch.*layer_norm"),
    (check_layer_norm, lambda x, w, b, eps: torch.layer_norm(x, x.shape[-1:], w, b, eps), r"called torch.*layer_norm"),
    (
        check_layer_norm,
        lambda x, w, b, eps: torch.ops.aten.native_layer_norm(x, x.shape[-1:], w, b, eps)[0],
        r"called torch.ops.aten.native_layer_norm",
    ),
    (
        check_layer_norm,
        lambda x, w, b, eps: F.group_norm(x.reshape(-1, 1, x.shape[-1]), 1, eps=eps).reshape(x.shape) * w + b,
        r"called torch.*group_norm",
    ),
    (
        check_layer_norm,
        lambda x, w, b, eps: parts.layer_norm(x, w, b, eps),
        r"called llmcourse\.engine\.parts\.layer_norm",
    ),
    (check_gelu, lambda x: F.gelu(x, approximate="tanh"), r"called torch.*gelu"),
    (check_gelu, lambda x: torch.nn.GELU("tanh")(x), r"called torch.*gelu"),
    (check_gelu, lambda x: torch.ops.aten.gelu(x, approximate="tanh"), r"called torch.ops.aten.gelu"),
    (check_gelu, lambda x: parts.gelu(x), r"called llmcourse\.engine\.parts\.gelu"),
    (check_linear, lambda x, w, b: parts.linear(x, w, b), r"called llmcourse\.engine\.parts\.linear"),
    (
        check_mlp,
        lambda x, w1, b1, w2, b2: parts.linear(parts.gelu(parts.linear(x, w1, b1)), w2, b2),
        r"called llmcourse\.engine\.parts\.(linear|gelu)",
    ),
    (
        check_block,
        lambda x, w, n_head, eps=1e-5: reference_block(x, w, n_head, eps),
        r"called llmcourse\.(engine\.parts|checks)",
    ),
    (
        check_gpt2_forward,
        lambda sd, ids, n_head, eps=1e-5: reference_forward(sd, ids, n_head, eps),
        r"called llmcourse\.(engine\.model\.GPT2|checks\.gpt2\.reference_forward)",
    ),
    (
        check_load_gpt2_checkpoint,
        lambda folder: (
            llmcourse.load_model(folder).state_dict(),
            json.loads((Path(folder) / "config.json").read_text()),
        ),
        r"called llmcourse\.engine\.loading\.load_model",
    ),
]


@pytest.mark.parametrize(
    "check, wrong, message", BLACK_BOXES, ids=[f"{c.__name__}-{i}" for i, (c, _, _) in enumerate(BLACK_BOXES)]
)
def test_black_box_is_rejected_however_it_is_reached(check, wrong, message):
    with pytest.raises(CheckFailed, match=message):
        check(wrong)


def test_the_engine_still_works_after_a_check_that_forbids_it():
    with pytest.raises(CheckFailed):
        check_gelu(lambda x: parts.gelu(x))
    assert sys.getprofile() is None
    assert torch.allclose(parts.gelu(torch.tensor([1.0])), torch.tensor([0.8412]), atol=1e-4)


# -- errors, hangs, wrong types -----------------------------------------------------------------


def test_errors_wrong_types_and_shapes_get_clear_messages():
    with pytest.raises(CheckFailed, match=r"raised ZeroDivisionError[\s\S]*at line"):
        check_gelu(lambda x: 1 / 0)
    with pytest.raises(CheckFailed, match=r"expected a torch.Tensor of shape \(7,\), got \[-3\.0"):
        check_gelu(lambda x: x.tolist())
    with pytest.raises(CheckFailed, match=r"expected shape \(3, 5\), got \(5, 3\)"):
        check_linear(lambda x, w, b: (x @ w + b).T)
    with pytest.raises(CheckFailed, match=r"changed its input `x`"):
        check_layer_norm(lambda x, w, b, eps: layer_norm(x.sub_(x.mean(-1, keepdim=True)), w, b, eps))
    with pytest.raises(CheckFailed, match=r"expected a pair \(state_dict, config\)"):
        check_load_gpt2_checkpoint(lambda folder: load_gpt2_checkpoint(folder)[0])


def test_a_hang_is_stopped(monkeypatch):
    import llmcourse.checks.gpt2 as gpt2_checks

    real = gpt2_checks.run_check
    monkeypatch.setattr(gpt2_checks, "run_check", lambda *a, **kw: real(*a, **{**kw, "seconds": 0.5}))

    def gelu_forever(x):
        while True:
            x = x + 0

    with pytest.raises(CheckFailed, match=r"did not finish within its 0.5 CPU-s"):
        check_gelu(gelu_forever)


# -- the references against torch and transformers ----------------------------------------------


def test_reference_block_equals_the_engines_one_layer_model():
    config = GPT2Config(n_layer=1, n_head=4, n_embd=32, n_positions=16, vocab_size=40)
    sd = lively_state_dict(config, seed=3)
    ids = torch.randint(40, (2, 9), generator=torch.Generator().manual_seed(0))
    model = llmcourse.GPT2(config)
    model.load_state_dict(sd)
    with torch.no_grad():
        expected = model(ids)
    got = gpt2_forward(sd, ids, 4)
    assert (got - expected).abs().max() < 1e-4
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    w = block_weights(32, seed=1)
    # two float32 orders of the same sums (the engine's C kernels, the notebook's torch ops): they differ by float32
    # rounding (6e-8 relative) grown through ~100-term sums, about 2e-5 on outputs near 3
    assert torch.allclose(reference_block(x, w, 4), block(x, w, 4), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "config",
    [
        GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=500),
        GPT2Config(n_layer=12, n_head=2, n_embd=8, n_positions=16, vocab_size=30),
    ],
    ids=["small", "12-layers"],
)
def test_reference_forward_equals_transformers(config):
    sd = lively_state_dict(config, seed=5)
    ids = torch.randint(config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    expected = hf_logits(sd, ids, config.n_head)
    assert (reference_forward(sd, ids, config.n_head) - expected).abs().max() < 1e-4
    assert (gpt2_forward(sd, ids, config.n_head) - expected).abs().max() < 1e-4


def test_the_124m_configuration_against_the_engine_and_transformers(capsys):
    """Random weights in GPT-2 small's shapes (12 layers, 12 heads, 768, vocab 50257), batch 2."""
    check_gpt2_forward(gpt2_forward, n_random=0, gpt2_124m=True, transformers=True)
    assert "✓ gpt2_forward — 11 cases" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match=r"h\.10 before h\.2"):
        check_gpt2_forward(forward_string_order, seed=0, n_random=0, gpt2_124m=True)


def test_transformers_comparison_catches_what_the_engine_would_miss(monkeypatch):
    """The hidden check also asks transformers: a wrong answer the engine shares is still caught."""
    import llmcourse.checks.gpt2 as gpt2_checks

    real = gpt2_checks.reference_forward
    monkeypatch.setattr(gpt2_checks, "reference_forward", lambda *a, **kw: real(*a, **kw) * 1.001)
    with pytest.raises(CheckFailed):
        check_gpt2_forward(lambda sd, ids, h, eps=1e-5: gpt2_forward(sd, ids, h, eps) * 1.001, transformers=True)


def test_checkpoint_folders_load_in_transformers_and_the_engine(tmp_path):
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    for description, folder in checkpoint_folders(tmp_path, transformers=True):
        sd, config = load_gpt2_checkpoint(folder)
        ref_sd, _ = reference_checkpoint(folder)
        assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in sd), description
        ids = torch.randint(config["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(0))
        hf = GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            expected = hf(ids).logits
        assert (gpt2_forward(sd, ids, config["n_head"]) - expected).abs().max() < 1e-4, description
        assert (llmcourse.load_model(folder, device="cpu")(ids) - expected).abs().max() < 1e-4, description


def test_the_bundled_model_runs_in_the_learners_forward():
    sd, config = load_gpt2_checkpoint(llmcourse.engine.loading.MODELS_DIR / "gpt2-shakespeare")
    model = llmcourse.load_model(device="cpu")
    ids = torch.tensor([llmcourse.get_tokenizer().encode("ROMEO:\nBut soft")])
    assert (gpt2_forward(sd, ids, config["n_head"]) - model(ids)).abs().max() < 1e-4


def test_an_unwritten_exercise_that_is_called_is_named():
    def gelu_stub(x):
        raise NotImplementedError()

    def mlp_with_stub(x, w1, b1, w2, b2):
        return linear(gelu_stub(linear(x, w1, b1)), w2, b2)

    with pytest.raises(CheckFailed, match=r"raised RuntimeError: it calls gelu_stub, which is not written yet"):
        check_mlp(mlp_with_stub)
    with pytest.raises(CheckFailed, match=r"gpt2_forward is not written yet"):
        check_gpt2_forward(stub)


def test_an_answer_just_outside_the_accuracy_contract_says_what_accuracy_was_expected():
    def layer_norm_slightly_off(x, weight, bias, eps):
        return layer_norm(x, weight, bias, eps) * (1 + 3e-5)

    with pytest.raises(
        CheckFailed,
        match=r"allowed [\d.e-]+ there[\s\S]*close, but not as accurate as expected: "
        r"layer_norm may be off by 8·√C units",
    ):
        check_layer_norm(layer_norm_slightly_off)


def test_a_part_that_fails_only_in_the_engine_is_caught_there_and_the_model_is_not_printed():
    def gelu_upcasting_in_the_engine(x):
        return gelu(x).float() if x.shape[-1] == 64 and x.dim() == 3 and x.shape[0] == 3 else gelu(x)  # 4C of the model

    with pytest.raises(
        CheckFailed,
        match=r"model = <tiny GPT-2: 2 layers, n_embd 16, float16[^\n]*>; model\.parts = "
        r"guarded\(Parts, gelu=gelu\)[\s\S]*part 'gelu'",
    ) as caught:
        check_gelu(gelu_upcasting_in_the_engine)
    assert "Affine" not in str(caught.value) and "ModuleList" not in str(caught.value)
