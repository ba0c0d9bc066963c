"""`forbidding`: black boxes (`Forbidden`) the learner's function may not call, caught however reached.

The targets are compiled into rules (code objects, C functions, classes, modules, torch names) that
one profile function (`sys.setprofile`) compares with every call while the learner's code runs.
Three more watches see what it cannot: an import finder refuses to load a forbidden module (before
any of it runs: a slow import is refused at once, not timed out), TorchScript's functions and methods
are refused by their qualified name (`torch.jit.script(engine_function)`, run in C++), and a
learner's code object whose content is a forbidden function's (its source copied by
`inspect.getsource` and exec'd) is refused as that function. `NOT_ENFORCEABLE` lists what no
in-process watch can catch.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import types
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmcourse.course import limits

NOT_ENFORCEABLE = [
    "answers computed before the check runs and reused inside the function (a table built in another "
    "cell, a precomputed result, data such as `ranks` or `vocab`)",
    "work done in another thread or process (threading, multiprocessing, concurrent.futures, subprocess)",
    "C code reached from C without passing through Python or torch's operators (the internals of an allowed C "
    "function; ctypes / cffi, e.g. a C library's own matrix product)",
    "a cached result of another library's function (functools.lru_cache / cache) that was computed "
    "before the check: the cache answers without running code the check can see",
    "a copy of a black box's source code pasted or exec'd as the learner's own and then edited (a name or its "
    "docstring changed), or copied from a third-party package forbidden as a whole (transformers): an unedited "
    "copy of a function the rules name, or of any function of a forbidden llmcourse module, is caught",
    "frames reached through attributes (an exception's __traceback__.tb_frame.f_back): the check's "
    "expected answers are computed after the call, so there is nothing to find there, but other state is",
    "anything not on the exercise's list (other libraries' sorting or selection, e.g. numpy.argpartition, "
    "heapq.nlargest, sorted)",
]


# torch functions that compute the same thing under other names (private kernels, fused variants, the
# aten operators the public ones dispatch to): forbidding one name of a group forbids them all, by name
# (torch.X, Tensor.X) and as aten operators, however they are reached (torch.ops.aten.X.default._op,
# a torch.jit.script'ed function, torch._C._nn.X_).
_ATTENTION = {
    "scaled_dot_product_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_attention_math_for_mps",
    "_native_multi_head_attention",
    "_transformer_encoder_layer_fwd",
    "multi_head_attention_forward",
    "_fused_sdp_choice",
}
_SOFTMAX = {
    "softmax",
    "_softmax",
    "_safe_softmax",
    "_masked_softmax",
    "log_softmax",
    "_log_softmax",
    "special_softmax",
    "special_log_softmax",
    "logsumexp",
    "special_logsumexp",
    "cross_entropy",
    "cross_entropy_loss",
    "nll_loss",
    "nll_loss_forward",
    "nll_loss2d_forward",
} | _ATTENTION
SAME_JOB = [  # the first group that holds a name is that name's
    _ATTENTION,
    _SOFTMAX,
    {
        "layer_norm",
        "native_layer_norm",
        "group_norm",
        "native_group_norm",
        "batch_norm",
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_no_training",
        "_native_batch_norm_legit_functional",
        "_batch_norm_impl_index",
        "_batch_norm_with_update",
        "_batch_norm_no_update",
        "instance_norm",
        "rms_norm",
        "_fused_rms_norm",
    },
    {"gelu", "gelu_", "_gelu"},
    {"silu", "silu_", "_silu"},
    {"norm", "vector_norm", "linalg_vector_norm", "linalg_norm", "frobenius_norm", "nuclear_norm", "_norm"},
    {"embedding", "embedding_bag", "_embedding_bag", "_embedding_bag_forward_only", "_embedding_bag_backward"},
    {"topk"},
    {"multinomial"},
    {
        "quantize_per_channel",
        "quantize_per_tensor",
        "quantize_per_tensor_dynamic",
        "_weight_int8pack_mm",
        "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_weight_int4pack_mm_with_scales_and_zeros",
        "_convert_weight_to_int4pack",
        "_convert_weight_to_int4pack_for_cpu",
        "fbgemm_linear_int8_weight",
        "fbgemm_linear_int8_weight_fp32_activation",
        "fbgemm_linear_quantize_weight",
        "fbgemm_pack_quantized_matrix",
        "_dyn_quant_matmul_4bit",
        "_dyn_quant_pack_4bit_weight",
        "int_repr",
        "q_per_channel_scales",
        "dequantize",
    },
]
_QUANTIZED_NAMESPACES = ("quantized", "_quantized", "quantized_decomposed")

# Introspection that reaches the check's own frames (and so its expected answers), or switches the watch
# off: refused in every check, when the learner's own code calls it (libraries may use it inside).
INTROSPECTION = (
    "sys._getframe",
    "sys._current_frames",
    "sys.setprofile",
    "sys.settrace",
    "threading.setprofile",
    "threading.settrace",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
    "inspect.currentframe",
    "inspect.stack",
    "inspect.getouterframes",
    "inspect.trace",
    "traceback.walk_stack",
    "traceback.extract_stack",
    "torch._C._pop_torch_dispatch_stack",
    "torch.utils._python_dispatch._pop_mode",
    "torch._C._unset_dispatch_mode",
)
_PEEK_TEXT = "introspection"
_PEEKING = (
    "reads the frames or objects of the check that calls it (where the expected answers live) or "
    "switches off its watch: compute the answer from the arguments"
)


class ForbiddenCall(RuntimeError):
    """The learner's function called the black box its exercise replaces."""


@dataclasses.dataclass(frozen=True)
class Forbidden:
    """A black box the learner's function may not call, however it reaches it; `instead` says what to do.

    `target` is
    - a function or method: 'llmcourse.course.bpe.merge', 'codecs.getincrementaldecoder', 'torch.topk'
      (a torch function forbids every torch function of that name: torch.topk, Tensor.topk,
      torch.ops.aten.topk, ...);
    - a class: 'llmcourse.engine.tokenizer.StreamDecoder', 'tiktoken._tiktoken.CoreBPE' (constructing it or
      calling any of its methods, in subclasses too);
    - a module or package: 'tiktoken', 'transformers' (any function defined in it, even if it is
      imported only during the call).

    `direct`: refused only where the learner's own code calls it (a function or module): the engine that a check
    runs around the learner's part may use it (the engine's C kernels, `llmcourse.engine.cpu_kernels`).
    """

    target: str
    instead: str = ""
    direct: bool = False


@dataclasses.dataclass
class _Rules:
    """Forbidden targets compiled into what the watch compares, fast."""

    codes: dict = dataclasses.field(default_factory=dict)  # id(code object) -> rule
    builtins: dict = dataclasses.field(default_factory=dict)  # id(C function) -> rule
    classes: dict = dataclasses.field(default_factory=dict)  # class -> rule (C methods on its instances)
    methods: dict = dataclasses.field(default_factory=dict)  # C method name -> [(class, rule)]
    modules: dict = dataclasses.field(default_factory=dict)  # module prefix -> rule
    torch_names: dict = dataclasses.field(default_factory=dict)  # torch function name -> rule
    aten_names: dict = dataclasses.field(default_factory=dict)  # aten operator name -> rule (SAME_JOB groups)
    caches: list = dataclasses.field(default_factory=list)  # lru_cache wrappers to clear at the start
    copies: dict = dataclasses.field(default_factory=dict)  # content id (`_content_id`) -> (rule, what it copies)
    names: dict = dataclasses.field(default_factory=dict)  # dotted name of a function or class -> rule (TorchScript)
    keep: list = dataclasses.field(default_factory=list)  # keeps the objects whose ids are used alive


def _resolve(target: str) -> tuple[Any, str]:
    """'torch.Tensor.topk' -> (torch.Tensor, 'topk'); the object that owns the attribute."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    if hasattr(builtins, parts[0]):  # 'str.upper', 'bytes.decode'
        owner = getattr(builtins, parts[0])
        for name in parts[1:-1]:
            owner = getattr(owner, name)
        return (owner, parts[-1]) if len(parts) > 1 else (builtins, parts[0])
    raise ValueError(f"cannot resolve {target!r}")


def _is_module(target: str) -> bool:
    if target in sys.modules:
        return isinstance(sys.modules[target], types.ModuleType)
    try:
        return importlib.util.find_spec(target) is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _add_function(rules: _Rules, fn: Any, rule: Forbidden) -> None:
    seen = 0
    _add_name(rules, fn, rule)
    while fn is not None and seen < 10:
        seen += 1
        if isinstance(fn, functools._lru_cache_wrapper):
            rules.caches.append(fn)
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if isinstance(fn, property):
            for part in (fn.fget, fn.fset, fn.fdel):
                _add_function(rules, part, rule)
            return
        code = getattr(fn, "__code__", None)
        if isinstance(code, types.CodeType):
            rules.codes[id(code)] = rule
            rules.keep.append(code)
            _add_copies(rules, code, rule, f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}")
        elif isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            rules.builtins[id(fn)] = rule
            rules.keep.append(fn)
        elif isinstance(fn, (types.MethodDescriptorType, types.ClassMethodDescriptorType)):
            rules.methods.setdefault(fn.__name__, []).append((fn.__objclass__, rule))
        fn = getattr(fn, "__wrapped__", None)


def _add_name(rules: _Rules, fn: Any, rule: Forbidden) -> None:
    """fn's dotted name (module.qualname), by which TorchScript names what it compiles from it."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str):
        rules.names.setdefault(f"{module}.{qualname}", rule)


# Code objects by content: a copy of a function (its source exec'd elsewhere) has the same docstring, constants and
# names as the original, but another identity, file and first line -- and not always the same bytecode (CPython 3.11
# compiles `torch.softmax(x)` otherwise when `torch` is a name the module imports than when it compiles the function
# alone), so the bytecode is not compared.
_CONTENT_IDS: dict = {}  # content -> a small int standing for it


def _content(code: types.CodeType) -> tuple:
    """What a copy of `code` has in common with it: not its file, line numbers, bytecode or name."""
    consts = tuple(_content(c) if isinstance(c, types.CodeType) else (type(c), c) for c in code.co_consts)
    return (
        consts,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
    )


def _content_id(code: types.CodeType) -> int:
    return _CONTENT_IDS.setdefault(_content(code), len(_CONTENT_IDS))


def _documented(code: types.CodeType) -> bool:
    """Whether `code` is a function with a docstring (in CPython its first constant): only a copy shares it, so a
    learner's own function that happens to compile to the same bytecode (a one-line formula) is never taken for
    a copy."""
    first = code.co_consts[0] if code.co_consts else None
    return not code.co_name.startswith("<") and isinstance(first, str) and bool(first.strip())


def _add_copies(rules: _Rules, code: types.CodeType, rule: Forbidden, name: str) -> None:
    """The contents of `code` and of the documented functions defined inside it, refused in copies."""
    if _documented(code):
        rules.copies.setdefault(_content_id(code), (rule, name))
    for inner in code.co_consts:
        if isinstance(inner, types.CodeType):
            _add_copies(rules, inner, rule, f"{name}.<locals>.{inner.co_name}")


def _add_module_copies(rules: _Rules, module: types.ModuleType, rule: Forbidden) -> None:
    """The Python functions and methods a module defines, refused in copies and by their TorchScript names."""
    name = module.__name__
    for value in list(vars(module).values()):
        if getattr(value, "__module__", None) != name:
            continue
        members = list(vars(value).values()) if isinstance(value, type) else [value]
        for member in members:
            fn = getattr(member, "__func__", member)  # staticmethod, classmethod
            if isinstance(fn, types.FunctionType):
                _add_copies(rules, fn.__code__, rule, f"{name}.{fn.__qualname__}")


def _add_class(rules: _Rules, cls: type, rule: Forbidden) -> None:
    rules.classes[cls] = rule
    _add_name(rules, cls, rule)
    for klass in cls.__mro__:
        if klass is object or klass.__module__ == "builtins" and klass is not cls:
            continue
        for value in vars(klass).values():
            if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
                _add_function(rules, value, rule)


def _compile(forbid: Sequence[Forbidden]) -> _Rules:
    rules = _Rules()
    for rule in forbid:
        target = rule.target
        if target.startswith("torch.") and not _is_module(target):
            name = target.rsplit(".", 1)[1]
            rules.names.setdefault(target, rule)  # torch.jit.script(F.silu)
            rules.torch_names.setdefault(name, rule)  # every route: torch.X, Tensor.X, torch.ops.aten.X
            for alias in next((group for group in SAME_JOB if name in group), ()):
                rules.torch_names.setdefault(alias, rule)
                rules.aten_names.setdefault(alias, rule)  # seen as operators, however they are reached
            continue
        if _is_module(target):
            rules.modules[target] = rule
            for name, module in list(sys.modules.items()):
                if module is None or not (name == target or name.startswith(target + ".")):
                    continue
                if target.split(".")[0] == "llmcourse":  # the course's own: a few hundred functions to know by content
                    _add_module_copies(rules, module, rule)
                native = str(getattr(module, "__file__", "") or "").endswith((".so", ".pyd"))
                for value in list(vars(module).values()):
                    if isinstance(value, functools._lru_cache_wrapper) and value.__module__ == name:
                        rules.caches.append(value)  # a cached answer would come back without running its code
                    home = getattr(value, "__module__", None)
                    # defined in the package, or (an extension module's classes may say 'builtins') by this
                    # extension module itself -- not a type a Python module imported (types.ModuleType, ...)
                    ours = (
                        (home or "").startswith(target + ".")
                        or home == target
                        or (
                            native
                            and home in ("builtins", None)
                            and getattr(builtins, getattr(value, "__name__", ""), None) is not value
                            and not any(value is v for v in vars(types).values())
                        )
                    )
                    if not ours:
                        continue
                    if isinstance(value, type):
                        # its instances' C methods, and its static C functions (tiktoken's CoreBPE, the
                        # Rust classes of `tokenizers`, which may not say where they live)
                        rules.classes[value] = rule
                        for member in list(vars(value).values()):
                            if isinstance(member, staticmethod) and isinstance(
                                member.__func__, types.BuiltinFunctionType
                            ):
                                rules.builtins[id(member.__func__)] = rule
                                rules.keep.append(member.__func__)
                    elif isinstance(value, types.BuiltinFunctionType):
                        rules.builtins[id(value)] = rule
                        rules.keep.append(value)
            continue
        try:
            owner, name = _resolve(target)
            obj = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
        except (ValueError, AttributeError, ImportError) as err:
            if target.split(".")[0] == "llmcourse":  # the package's own: a name that resolves to nothing is a bug
                raise ValueError(
                    f"Forbidden({target!r}) names nothing in llmcourse ({err}): the rule would forbid nothing"
                ) from err
            continue  # a library that is not installed: nothing to call
        rules.names.setdefault(target, rule)
        if isinstance(obj, type):
            _add_class(rules, obj, rule)
        else:
            _add_function(rules, obj, rule)
            if isinstance(owner, type) and not isinstance(obj, (staticmethod, classmethod)):
                _add_function(rules, getattr(owner, name), rule)
    return rules


_compiled: dict[tuple, tuple[int, _Rules]] = {}  # rules -> (len(sys.modules) then, compiled)


def _rules_for(forbid: Sequence[Forbidden]) -> _Rules:
    key, modules = tuple(forbid), len(sys.modules)  # a newly imported package brings new classes to look at
    cached = _compiled.get(key)
    if cached is None or cached[0] != modules:
        cached = _compiled[key] = (modules, _compile(forbid))
    return cached[1]


def _message(rule: Forbidden, reached: str, verb: str = "called", copy_of: str = "") -> str:
    """'your function called X (that is T), the black box ...': `verb` 'imported' for a module it imports, `copy_of`
    the original when X is a copy of a forbidden function."""
    if rule.instead == _PEEK_TEXT:
        return f"your function called {reached}, which {_PEEKING}."
    if rule is _CHECKS_RULE:
        return f"your function called {reached}, one of the check's own functions. {rule.instead}"
    if copy_of:
        reached, via = f"{reached}, a copy of {copy_of} (the same code: its source exec'd)", ""
    elif reached == rule.target:
        via = ""
    else:
        via = f" ({'part of ' if _is_module(rule.target) else 'that is '}{rule.target})"
    return (
        f"your function {verb} {reached}{via}, the black box this exercise asks you to write yourself. {rule.instead}"
    ).rstrip()


_MISSING = object()


def _torch_op_calls() -> set[int]:
    """Ids of the code objects that run `torch.ops.aten.X(...)` and `torch.ops.aten.X.default(...)`."""
    ids = set()
    for cls in (torch._ops.OpOverload, torch._ops.OpOverloadPacket):
        code = getattr(getattr(cls, "__call__", None), "__code__", None)
        if code is not None:
            ids.add(id(code))
    return ids


_OP_CALLS = _torch_op_calls()

_HARNESS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_CHECKS_DIR = os.path.dirname(_HARNESS_DIR.rstrip(os.sep)) + os.sep
# The watch's own modules run inside the learner's call (the time-out's signal handler, the child's output,
# the aten watch): never refused.
_MACHINERY = {os.path.join(_HARNESS_DIR, f"{name}.py") for name in ("forbid", "isolate", "core")}
_LIBRARIES = tuple(p for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "purelib", "platlib")} if p)


_FACTS: dict = {}  # id(code) -> (whether it is a reference helper of the checks, its content id or -1)


def _facts(code: types.CodeType) -> tuple[bool, int]:
    """What the watch needs to know of a code object, found once: whether it is one of the checks' own functions
    (their references, expected answers and known mistakes), which a learner's function may not call -- methods of
    the checks' classes are allowed: checks hand learners such objects (scripted models, recorded caches) --, and,
    for code outside the libraries (the learner's), its content id (to recognise a copy of a forbidden function)."""
    known = _FACTS.get(id(code))
    if known is None:
        parts = code.co_qualname.split(".")
        filename = code.co_filename
        helper = (
            filename.startswith(_CHECKS_DIR)
            and filename not in _MACHINERY
            and parts[-1] not in ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")
            and (len(parts) == 1 or parts[-2] == "<locals>")
        )
        library = filename.startswith((*_LIBRARIES, _PACKAGE_DIR)) or filename.startswith("<frozen")
        known = _FACTS[id(code)] = (helper, -1 if library or not _documented(code) else _content_id(code))
        _KEEP.append(code)  # its id stays its own
    return known


_KEEP: list = []


def _learners(frame) -> bool:
    """Whether `frame` runs the learner's own code (not a library's, not the standard library's)."""
    filename = frame.f_code.co_filename
    return (
        not filename.startswith(_LIBRARIES)
        and not filename.startswith(_PACKAGE_DIR)
        and not filename.startswith("<frozen")
    )


_PACKAGE_DIR = os.path.dirname(_CHECKS_DIR.rstrip(os.sep)) + os.sep


def _applies(rule: Forbidden, caller) -> bool:
    """Whether `rule` refuses a call made from the frame `caller`: a `direct` rule only the learner's own calls."""
    return not rule.direct or (caller is not None and _learners(caller))


class DispatchWatch(TorchDispatchMode):
    """A TorchDispatchMode for the checks' watches: torch would wrap a subclass's __torch_dispatch__ so that its first
    call imports torch._dynamo (1.4 s, 800 modules), and every check's child process would pay that again."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


class _AtenWatch(DispatchWatch):
    """Sees every aten operator that runs, however it was reached, and refuses the forbidden ones by name."""

    def __init__(self, watch: "forbidding", names: dict, quantized: Optional[Forbidden]):
        super().__init__()
        self.watch, self.names, self.quantized = watch, names, quantized

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        packet = func.overloadpacket
        rule = self.names.get(packet.__name__)
        if rule is None and self.quantized is not None and func.namespace in _QUANTIZED_NAMESPACES:
            rule = self.quantized
        if rule is not None:
            self.watch.refuse(rule, f"torch.ops.{func.namespace}.{packet.__name__}")
        return func(*args, **(kwargs or {}))


class forbidding:
    """`with forbidding(rules):` — calls to the forbidden black boxes raise ForbiddenCall.

    A profile function (`sys.setprofile`) sees every Python frame that starts and every C function
    called from Python, so it catches a black box however the learner reached it. Whatever the
    learner does with the error, `violation` keeps the first one's message, so a check fails even
    when the learner's code caught it. If another profiler is running (e.g. `%prun`), it is left
    alone and nothing is watched.
    """

    def __init__(self, forbid: Sequence[Forbidden]):
        rules = _rules_for(forbid) if forbid else _Rules()
        self.rules = rules
        self.codes, self.builtins, self.copies = rules.codes, rules.builtins, rules.copies
        self.names = {**{name: None for name in rules.methods}, **{name: None for name in rules.torch_names}}
        self.by_module = bool(rules.modules)
        self.module_rules: dict = {}  # module name -> rule or None, filled as modules are seen
        self.type_rules: dict = {}  # class -> rule or None, filled as classes are seen
        self.violation: Optional[str] = None
        self.profiling = False
        self.peeking = _peeking_rules()
        quantized = next(
            (rules.aten_names[n] for n in ("quantize_per_channel", "_weight_int8pack_mm") if n in rules.aten_names),
            None,
        )
        self.aten = _AtenWatch(self, rules.aten_names, quantized) if rules.aten_names else None

    def refuse(self, rule: Forbidden, reached: str, verb: str = "called", copy_of: str = ""):
        message = _message(rule, reached, verb, copy_of)
        if self.violation is None:
            self.violation = message
        raise ForbiddenCall(message)

    def _module_rule(self, module: Optional[str]) -> Optional[Forbidden]:
        rule = self.module_rules.get(module, _MISSING)
        if rule is _MISSING:
            rule = None
            if module:
                for prefix, candidate in self.rules.modules.items():
                    if module == prefix or module.startswith(prefix + "."):
                        rule = candidate
                        break
            self.module_rules[module] = rule
        return rule

    def _type_rule(self, cls: type) -> Optional[Forbidden]:
        rule = self.type_rules.get(cls, _MISSING)
        if rule is _MISSING:
            classes = self.rules.classes
            rule = next((classes[k] for k in getattr(cls, "__mro__", (cls,)) if k in classes), None)
            self.type_rules[cls] = rule
        return rule

    def _named(self, arg: Any, name: str, owner: Any) -> Optional[tuple[Forbidden, str]]:
        """A C function or method whose name is forbidden: torch's X (torch.X, Tensor.X), or a C method."""
        rules = self.rules
        for cls, rule in rules.methods.get(name, ()):
            if isinstance(owner, cls):
                return rule, f"{type(owner).__name__}.{name}"
        rule = rules.torch_names.get(name)
        if rule is not None:
            if isinstance(owner, torch.Tensor):
                return rule, f"torch.Tensor.{name}"
            module = getattr(arg, "__module__", None) or ""
            objclass = getattr(arg, "__objclass__", None)
            if (
                module.startswith("torch")
                or (isinstance(owner, type) and owner.__module__.startswith("torch"))
                or (objclass is not None and objclass.__module__.startswith("torch"))
            ):
                return rule, f"torch.{name}"
        return None

    def _profile(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            key = id(code)
            rule = self.codes.get(key)
            if rule is not None and _applies(rule, frame.f_back):
                self.refuse(rule, f"{frame.f_globals.get('__name__') or '?'}.{code.co_qualname}")
            rule = self.peeking.codes.get(key)
            if rule is not None and frame.f_back is not None and _learners(frame.f_back):
                self.refuse(rule, f"{frame.f_globals.get('__name__') or '?'}.{code.co_qualname}")
            helper, content = _facts(code)
            if helper and frame.f_back is not None and _learners(frame.f_back):
                self.refuse(_CHECKS_RULE, f"{frame.f_globals.get('__name__') or '?'}.{code.co_qualname}")
            if content >= 0 and content in self.copies:
                rule, original = self.copies[content]
                if _applies(rule, frame.f_back):
                    name = f"{frame.f_globals.get('__name__') or '?'}.{code.co_qualname}"
                    self.refuse(rule, name, copy_of=original)
            if key in _OP_CALLS and self.rules.torch_names:  # torch.ops.aten.X(...)
                op = str(frame.f_locals.get("self", ""))  # 'aten.topk' or 'aten.topk.default'
                parts = op.split(".")
                if len(parts) > 1 and parts[1] in self.rules.torch_names:
                    self.refuse(self.rules.torch_names[parts[1]], f"torch.ops.{parts[0]}.{parts[1]}")
            if self.by_module:
                module = frame.f_globals.get("__name__")
                rule = self._module_rule(module)
                if rule is not None and _applies(rule, frame.f_back):
                    self.refuse(rule, _frame_name(frame, module, rule))
        elif event == "c_call":
            rule = self.builtins.get(id(arg))
            if rule is not None and _applies(rule, frame):
                self.refuse(rule, _c_name(arg))
            rule = self.peeking.builtins.get(id(arg))
            if rule is not None and _learners(frame):
                self.refuse(rule, _c_name(arg))
            owner = getattr(arg, "__self__", None)
            name = getattr(arg, "__name__", None)
            if name in self.names:
                found = self._named(arg, name, owner)
                if found is not None:
                    self.refuse(*found)
            if self.rules.classes and owner is not None:
                rule = self._type_rule(owner if isinstance(owner, type) else type(owner))
                if rule is not None:
                    self.refuse(rule, _c_name(arg))
            if self.by_module:
                rule = self._module_rule(getattr(arg, "__module__", None))
                if rule is not None and _applies(rule, frame):
                    self.refuse(rule, _c_name(arg))

    def script_rule(self, name: str) -> Optional[Forbidden]:
        """The rule refusing a TorchScript function or class of this dotted name (`_script_name`), or None."""
        return self.rules.names.get(name) or self._module_rule(name)

    def __enter__(self) -> "forbidding":
        rules = self.rules
        for cache in rules.caches:
            cache.cache_clear()  # a cached answer would come back without running code the watch sees
        if sys.getprofile() is None:  # another profiler (e.g. %prun) is running: leave it alone
            sys.setprofile(self._profile)
            self.profiling = True
        if self.aten is not None:
            self.aten.__enter__()
        if rules.modules or rules.names:
            limits._critical += 1  # a time-out falling due here would leave the watches half set up
            try:
                _WATCHES.append(self)
                if len(_WATCHES) == 1:
                    _start_watching_scripts_and_imports()
            finally:
                limits._critical -= 1
        return self

    def __exit__(self, kind, err, tb) -> bool:
        limits._critical += 1
        try:
            if self in _WATCHES:
                _WATCHES.remove(self)
                if not _WATCHES:
                    _stop_watching_scripts_and_imports()
            if self.aten is not None:
                modes = torch.utils._python_dispatch._get_current_dispatch_mode_stack()
                if self.aten in modes:
                    self.aten.__exit__(None, None, None)
                elif self.violation is None:
                    self.violation = f"your function switched off the check's watch over torch's operators. {_PEEKING}"
            if self.profiling:
                if sys.getprofile() != self._profile and self.violation is None:
                    self.violation = f"your function switched off the check's watch (sys.setprofile). {_PEEKING}"
                sys.setprofile(None)
                self.profiling = False
        finally:
            limits._critical -= 1
        return False


_CHECKS_RULE = Forbidden("llmcourse.checks", "The checks' own functions compute the expected answers: write yours.")


# ----------------------------------------------------------------------------------------------
# What the profile function cannot see: TorchScript (compiled functions run in C++, called through a C type's
# __call__) and imports (a forbidden module is refused before any of it runs). Both are watched while at least one
# `forbidding` with module or name rules is active.

_WATCHES: list = []  # the active watches with rules for TorchScript names and imports, outermost first
_SCRIPT_TYPES = (torch.jit.ScriptFunction, torch._C.ScriptMethod)
_SCRIPT_CALLS = {kind: kind.__call__ for kind in _SCRIPT_TYPES}  # their own __call__, put back when no watch is on


def _script_name(scripted: Any) -> str:
    """The dotted name of what TorchScript compiled: a function's, or a method's class ('__torch__.transformers.
    activations.___torch_mangle_3.NewGELUActivation' is transformers.activations.NewGELUActivation)."""
    if isinstance(scripted, torch._C.ScriptMethod):
        qualified = scripted.owner._type().qualified_name()
    else:
        qualified = scripted.qualified_name
    return re.sub(r"\.___torch_mangle_\d+", "", qualified.removeprefix("__torch__."))


def _watched_script_call(kind: type) -> Callable:
    original = _SCRIPT_CALLS[kind]

    def call(self, *args, **kwargs):
        name = _script_name(self)
        for watch in _WATCHES:
            rule = watch.script_rule(name)
            if rule is not None and _applies(rule, sys._getframe(1)):
                watch.refuse(rule, name, verb="called the TorchScript-compiled")
        return original(self, *args, **kwargs)

    return call


class _ImportWatch(importlib.abc.MetaPathFinder):
    """First on sys.meta_path while watching: a forbidden module that is not loaded yet is found as usual, but its
    loader refuses to run it (a probe such as importlib.util.find_spec still gets its answer). A `direct` rule is
    left to the profile function: who imports is not known here."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        rule = next((rule for watch in _WATCHES if (rule := watch._module_rule(name)) is not None), None)
        if rule is None or rule.direct:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                spec.loader = _RefusingLoader(rule)
                return spec
        return None


class _RefusingLoader(importlib.abc.Loader):
    def __init__(self, rule: Forbidden):
        self.rule = rule

    def create_module(self, spec: importlib.machinery.ModuleSpec):
        for watch in _WATCHES:
            if watch._module_rule(spec.name) is self.rule:
                watch.refuse(self.rule, spec.name, verb="imported")
        raise ImportError(f"{spec.name} is a black box here")  # the watch that refused it has ended

    def exec_module(self, module: types.ModuleType) -> None:
        raise ImportError(f"{module.__name__} is a black box here")


_IMPORTS = _ImportWatch()


def _start_watching_scripts_and_imports() -> None:
    for kind in _SCRIPT_TYPES:
        kind.__call__ = _watched_script_call(kind)
    sys.meta_path.insert(0, _IMPORTS)


def _stop_watching_scripts_and_imports() -> None:
    for kind, call in _SCRIPT_CALLS.items():
        kind.__call__ = call
    while _IMPORTS in sys.meta_path:
        sys.meta_path.remove(_IMPORTS)


@functools.lru_cache(maxsize=None)
def _peeking_rules() -> _Rules:
    return _compile([Forbidden(target, _PEEK_TEXT) for target in INTROSPECTION])


def _frame_name(frame, module: str, rule: Forbidden) -> str:
    """What the learner reached: a lazy package's `__getattr__(name)` is `package.name`."""
    code = frame.f_code
    name = frame.f_locals.get("name") if code.co_name == "__getattr__" else None
    if isinstance(name, str):
        return f"{rule.target}.{name}"
    return f"{module}.{code.co_qualname}"


def _c_name(arg: Any) -> str:
    owner = getattr(arg, "__self__", None)
    if isinstance(owner, types.ModuleType):
        where = owner.__name__.lstrip("_")  # _codecs.utf_8_decode is codecs.utf_8_decode
    elif isinstance(owner, type):
        where = owner.__name__
    elif owner is not None:
        where = type(owner).__name__
    else:
        qualname = getattr(arg, "__qualname__", None) or getattr(arg, "__name__", "?")
        return f"{getattr(arg, '__module__', None)}.{qualname}" if getattr(arg, "__module__", None) else qualname
    return f"{where}.{getattr(arg, '__name__', '?')}"


# Restoring the profile function is restoring state: a time-out that falls due meanwhile waits for the next tick.
limits._DEFER.update(f.__code__ for f in (forbidding.__enter__, forbidding.__exit__))
