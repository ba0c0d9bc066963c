"""Black boxes reached as data or native code (issue 41), refused by every chapter's check where they apply: the
engine's functions copied (`inspect.getsource` + `exec`, so that the learner's function is the engine's code under
another identity), compiled by TorchScript (`torch.jit.script`: it runs in C++), the engine's C kernels
(`cpu_kernels.linear`), transformers' activations (`ACT2FN`), imported before the check or inside the function
(an import slow on first use is refused at once, not timed out). Each chapter's correct solution still passes."""

import inspect
import math
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from llmcourse.checks import CheckFailed
from llmcourse.checks.attention import check_softmax
from llmcourse.checks.gpt2 import check_gelu, check_layer_norm, check_linear
from llmcourse.checks.modern import check_rms_norm, check_swiglu
from llmcourse.checks.sampling import check_top_k
from llmcourse.course.limits import work_seconds
from llmcourse.engine import cpu_kernels
from llmcourse.engine import parts as P
from llmcourse.engine import sampling as S

pytestmark = pytest.mark.usefixtures("one_thread")

# -- correct solutions, written as a learner would --------------------------------------------------------------


def softmax(x, dim=-1):
    e = (x - x.amax(dim, keepdim=True)).exp()
    return e / e.sum(dim, keepdim=True)


def layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def gelu(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def linear(x, weight, bias):
    return x @ weight + bias


def top_k(logits, k):
    kth = torch.topk(logits, min(k, logits.shape[-1])).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def rms_norm(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(gate, up):
    return gate * torch.sigmoid(gate) * up


SOLUTIONS = [
    (check_softmax, softmax),
    (check_layer_norm, layer_norm),
    (check_gelu, gelu),
    (check_linear, linear),
    (check_top_k, top_k),
    (check_rms_norm, rms_norm),
    (check_swiglu, swiglu),
]


@pytest.mark.parametrize("check, solution", SOLUTIONS, ids=[c.__name__ for c, _ in SOLUTIONS])
def test_a_correct_solution_passes(check, solution, capsys):
    check(solution)
    assert capsys.readouterr().out.startswith("✓")


# -- the routes to a black box ---------------------------------------------------------------------------------


def copied(fn):
    """fn's source exec'd in a learner's cell that imported what fn's module imports: a copy with fn's code."""
    module = inspect.getmodule(fn)
    scope = {"__name__": "__learner__", **{k: v for k, v in vars(module).items() if not k.startswith("__")}}
    exec(compile(inspect.getsource(fn), "<learner's cell>", "exec"), scope)
    assert scope[fn.__name__] is not fn and scope[fn.__name__].__code__.co_consts == fn.__code__.co_consts
    return scope[fn.__name__]


def scripted(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated, not gone
        compiled = torch.jit.script(fn)
    return lambda *args: compiled(*args)


def act2fn(name, then=lambda y, *rest: y):
    """transformers' activation `name`, looked up before the check runs (the module already imported)."""
    from transformers.activations import ACT2FN

    activation = ACT2FN[name]
    return lambda x, *rest: then(activation(x), *rest)


def scripted_module(name):
    """transformers' activation `name` compiled by TorchScript (its forward runs as a ScriptMethod, in C++)."""
    from transformers.activations import ACT2FN

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        module = torch.jit.script(ACT2FN[name])
    return lambda x: module.forward(x)


def act2fn_imported_inside(x):
    from transformers.activations import ACT2FN  # slow on first use: refused before it loads

    return ACT2FN["gelu_new"](x)


def kernel_linear(x, weight, bias):
    return cpu_kernels.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[-1])


def copied_kernel_linear(x, weight, bias):
    kernel = copied(cpu_kernels.linear)
    return kernel(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[-1])


def rms_norm_by(norm):
    """rms_norm from one of torch's norms: ‖x‖ / √C is the root of the mean square."""

    def rms_norm(x, weight, eps):
        x32 = x.float()
        rms = norm(x32) / math.sqrt(x.shape[-1])
        return weight * (x32 / torch.sqrt(rms * rms + eps)).to(x.dtype)

    return rms_norm


BLACK_BOXES = {
    "ch03 softmax, copied": (check_softmax, lambda: copied(P.softmax)),
    "ch03 softmax, jit.script": (check_softmax, lambda: scripted(P.softmax)),
    "ch04 layer_norm, copied": (check_layer_norm, lambda: copied(P.layer_norm)),
    "ch04 layer_norm, jit.script": (check_layer_norm, lambda: scripted(P.layer_norm)),
    "ch04 gelu, copied": (check_gelu, lambda: copied(P.gelu)),
    "ch04 gelu, ACT2FN gelu_new": (check_gelu, lambda: act2fn("gelu_new")),
    "ch04 gelu, ACT2FN imported inside": (check_gelu, lambda: act2fn_imported_inside),
    "ch04 gelu, ACT2FN jit.script": (check_gelu, lambda: scripted_module("gelu_new")),
    "ch04 linear, copied": (check_linear, lambda: copied(P.linear)),
    "ch04 linear, cpu_kernels.linear": (check_linear, lambda: kernel_linear),
    "ch04 linear, cpu_kernels.linear copied": (check_linear, lambda: copied_kernel_linear),
    "ch05 top_k, copied": (check_top_k, lambda: copied(S.top_k)),
    "ch05 top_k, jit.script": (check_top_k, lambda: scripted(S.top_k)),
    "ch11 rms_norm, copied": (check_rms_norm, lambda: copied(P.rms_norm)),
    "ch11 rms_norm, jit.script": (check_rms_norm, lambda: scripted(P.rms_norm)),
    "ch11 rms_norm, Tensor.norm": (check_rms_norm, lambda: rms_norm_by(lambda x: x.norm(dim=-1, keepdim=True))),
    "ch11 rms_norm, torch.linalg.norm": (
        check_rms_norm,
        lambda: rms_norm_by(lambda x: torch.linalg.norm(x, dim=-1, keepdim=True)),
    ),
    "ch11 rms_norm, torch.linalg.vector_norm": (
        check_rms_norm,
        lambda: rms_norm_by(lambda x: torch.linalg.vector_norm(x, dim=-1, keepdim=True)),
    ),
    "ch11 swiglu, F.silu in place": (check_swiglu, lambda: lambda g, u: F.silu(g.clone(), inplace=True) * u),
    "ch11 swiglu, copied": (check_swiglu, lambda: copied(P.swiglu)),
    "ch11 swiglu, jit.script": (check_swiglu, lambda: scripted(P.swiglu)),
    "ch11 swiglu, jit.script of F.silu": (check_swiglu, lambda: lambda g, u, silu=scripted(F.silu): silu(g) * u),
    "ch11 swiglu, ACT2FN silu": (check_swiglu, lambda: act2fn("silu", lambda y, up: y * up)),
}


@pytest.mark.parametrize("route", list(BLACK_BOXES))
def test_a_black_box_reached_as_data_or_native_code_is_refused(route):
    check, make = BLACK_BOXES[route]
    fn = make()
    start = work_seconds()
    with pytest.raises(CheckFailed, match="black box") as caught:
        check(fn)
    assert "did not finish" not in str(caught.value)
    assert work_seconds() - start < 5  # refused at once (the check's child process included)


def test_a_copy_is_named_as_a_copy_of_the_engines_function():
    with pytest.raises(CheckFailed, match=r"a copy of llmcourse\.engine\.sampling\.top_k \(the same code"):
        check_top_k(copied(S.top_k))


def test_a_scripted_function_is_named_by_its_qualified_name():
    with pytest.raises(CheckFailed, match=r"called the TorchScript-compiled llmcourse\.engine\.sampling\.top_k, the"):
        check_top_k(scripted(S.top_k))


def test_an_edited_copy_is_the_learners_own():
    """The same code with its docstring removed is no longer recognisable as a copy (NOT_ENFORCEABLE): here it is
    also a correct top_k of the learner's, which any check accepts."""
    source = inspect.getsource(S.top_k).replace(f'"""{S.top_k.__doc__}"""', "")
    scope = {"torch": torch, "Tensor": torch.Tensor}
    exec(compile(source, "<learner's cell>", "exec"), scope)
    check_top_k(scope["top_k"])


def test_a_forbidden_import_slow_on_first_use_is_refused_not_timed_out():
    """In a fresh process, where transformers is not imported yet (it takes seconds): refused before it loads."""
    script = (
        "from llmcourse.checks.gpt2 import check_gelu\n"
        "from llmcourse.course.limits import work_seconds\n"
        "def gelu(x):\n"
        "    from transformers.activations import ACT2FN\n"
        "    return ACT2FN['gelu_new'](x)\n"
        "start = work_seconds()\n"
        "try:\n"
        "    check_gelu(gelu)\n"
        "except Exception as err:\n"
        "    print(err)\n"
        "print(f'{work_seconds() - start:.2f} CPU-s')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300).stdout
    assert "your function imported transformers, the black box" in out
    assert float(out.split()[-2]) < 2
