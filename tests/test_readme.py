"""README.md's commands and its Python example run exactly as written."""

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")

# Commands the README shows that other tests run (bench: test_bench.py; pytest: CI itself) or that
# need a network (pip); `serve` runs until stopped: test_readme_serve_section_runs_as_written starts it.
ELSEWHERE = ("python -m llmcourse bench", "python -m pytest", "pip ", "python3 -m venv", "python -m llmcourse serve")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands() -> list[str]:
    lines = [line.split("  #")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    return [line for line in lines if line.startswith("python -m llmcourse") and not line.startswith(ELSEWHERE)]


def test_the_readme_shows_the_learners_commands():
    shown = commands()
    assert 'python -m llmcourse generate "ROMEO:"' in shown
    assert 'python -m llmcourse generate --parts chapters/ "ROMEO:"' in shown


@pytest.mark.parametrize("command", commands())
def test_readme_command_runs_as_written(command):
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONWARNINGS": "ignore"},
    )
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip()) > 20, done.stdout


def test_readme_python_example_runs(capsys):
    example = next(block for block in blocks("python") if "import llmcourse" in block)
    namespace: dict = {"__name__": "readme"}
    exec(compile(example, "README.md", "exec"), namespace)
    assert isinstance(namespace["text"], str) and len(namespace["ids"]) == 2
    assert capsys.readouterr().out.strip()


def test_readme_slot_examples_run_as_written():
    """The snippets that swap in a learner's parts, sampler functions and cache run as written, here
    with stand-ins that compute what the engine's own do: the engine then gives the same tokens."""
    import llmcourse
    from llmcourse.course.guards import GuardedCache
    from llmcourse.engine import parts, sampling

    snippets = [block for block in blocks("python") if "guarded(llmcourse." in block or "guard(" in block]
    assert len(snippets) == 2
    model = llmcourse.load_model(device="cpu")
    prompt = llmcourse.get_tokenizer().encode("ROMEO:")
    settings = dict(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=2)
    expected = llmcourse.generate(model, prompt, **settings)
    stand_ins = {
        "llmcourse": llmcourse,
        "model": model,
        "prompt": prompt,
        "my_gelu": parts.gelu,
        "my_softmax": parts.softmax,
        "my_top_p": sampling.top_p,
        "my_sample": sampling.sample,
        "MyKVCache": llmcourse.KVCache,
    }
    for snippet in snippets:
        exec(compile(snippet, "README.md", "exec"), stand_ins)
    # a swapped-in softmax brings the written-out attention that calls it
    functions = stand_ins["functions"]
    assert model.parts.overridden() == ["gelu", "softmax", "attention"]
    assert functions["sampler"].overridden() == ["top_p", "sample"]
    assert isinstance(model.new_cache(1, 4, cache_class=functions["kv_cache"]), GuardedCache)
    assert f"max_new_tokens={settings['max_new_tokens']}, temperature=0.9, top_p=0.9, seed=2" in snippets[1]
    assert stand_ins["ids"] == expected


def test_readme_serving_example_runs_as_written(capsys):
    """The LLMEngine example runs as written and gives the tokens `generate` gives each prompt alone."""
    import llmcourse

    example = next(block for block in blocks("python") if "LLMEngine" in block)
    model = llmcourse.load_model(device="cpu")
    tok = llmcourse.get_tokenizer()
    namespace = {"llmcourse": llmcourse, "model": model, "tok": tok}
    exec(compile(example, "README.md", "exec"), namespace)
    prompts = [tok.encode("KING:"), tok.encode("QUEEN:")]
    alone = [
        llmcourse.generate(model, prompts[0], temperature=0.8, seed=1),
        llmcourse.generate(model, prompts[1], max_new_tokens=8),
    ]
    assert namespace["outputs"] == alone
    hamlet = llmcourse.generate(model, tok.encode("HAMLET:"), max_new_tokens=10)
    cut = next((i + 1 for i in range(len(hamlet)) if "\n" in tok.decode(hamlet[: i + 1])), len(hamlet))
    rid = namespace["rid"]
    expected = [f"{rid} {tok.decode([t])!r} {i == cut - 1}" for i, t in enumerate(hamlet[:cut])]
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[:-1] == expected
    assert "'preemptions': 0" in printed[-1]


def test_readme_speculative_example_runs_as_written(capsys):
    """The speculative decoding example runs as written: its greedy tokens are plain greedy's (its own
    assert), the summary counts them, and prompt lookup's sampled text is reproducible."""
    import llmcourse

    example = next(block for block in blocks("python") if "draft=" in block)
    model = llmcourse.load_model(device="cpu")
    tok = llmcourse.get_tokenizer()
    namespace = {"llmcourse": llmcourse, "model": model, "tok": tok}
    exec(compile(example, "README.md", "exec"), namespace)
    stats = namespace["stats"]
    assert stats.new_tokens == len(namespace["ids"]) and stats.rounds
    assert capsys.readouterr().out.strip() == stats.summary()
    again = llmcourse.generate_text(model, tok, "To be, or not to be", draft="prompt-lookup", temperature=0.8, seed=1)
    assert namespace["text"] == again and again.strip()


def test_readme_quantization_example_runs_as_written(capsys):
    """The quantization example runs as written: the int4 model is several times smaller than float32, and the
    saved copy loads without re-quantizing (its own assert: the same tokens)."""
    import llmcourse

    example = next(block for block in blocks("python") if 'quantize="int4"' in block)
    namespace = {"llmcourse": llmcourse, "tok": llmcourse.get_tokenizer()}
    exec(compile(example, "README.md", "exec"), namespace)
    megabytes = float(capsys.readouterr().out.split()[0])
    floats = llmcourse.engine.quantize.resident_bytes(llmcourse.load_model(device="cpu")) / 1e6
    assert megabytes < floats / 6, (megabytes, floats)
    assert f"{megabytes:.1f} MB of weights (float32: {floats:.1f} MB)" in example
    assert llmcourse.engine.quantize.quantized_format(namespace["again"]) == "int4"


def test_the_readme_gives_one_test_time_and_says_who_runs_what():
    """One figure for the suite's time (it said 16–21 min in one place and 12 min in another), and the test
    command is marked as the contributors' (a learner's work in chapters/ is not the release it tests)."""
    paragraphs = [p for p in re.split(r"\n\s*\n", README) if "test suite" in p or "python -m pytest" in p]
    figures = {m for p in paragraphs for m in re.findall(r"(\d+(?:\s*(?:–|to)\s*\d+)?)\s*min", p) if "bench" not in p}
    assert figures == {"17"}, figures
    flat = " ".join(README.split())
    assert (
        "contributors: the whole test suite" in flat
        and "learners check theirs with `python -m llmcourse progress`" in flat
    )


def test_the_readme_names_every_default_where_the_command_line_differs():
    """`generate`'s keyword defaults against the CLI's: each difference is named in the README's sentence."""
    import dataclasses
    import inspect

    from llmcourse import SamplingParams, generate
    from llmcourse.__main__ import TEMPERATURE, build_parser

    gen = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("generate"))
    cli = {a.dest: a.default for a in gen._actions if a.default != "==SUPPRESS=="}
    cli["temperature"] = TEMPERATURE
    python = {n: p.default for n, p in inspect.signature(generate).parameters.items() if p.default is not p.empty}
    # the settings' defaults (stop, logit_bias: () here, [] on the command line, both none)
    python |= {f.name: list(f.default) if f.name in ("stop", "logit_bias") else f.default
               for f in dataclasses.fields(SamplingParams)}  # fmt: skip
    differ = {n for n in python if n in cli and cli[n] != python[n] and cli[n] is not None}
    assert differ == {"max_new_tokens", "temperature"}, differ
    sentence = " ".join(
        README.split("The command line has the same settings as flags", 1)[1].split("\n\n", 1)[0].split()
    )
    for name in differ:
        flag = "--" + name.replace("_", "-")
        assert f"`{flag} {cli[name]:g}`" in sentence and f"{python[name]:g}" in sentence, (name, sentence)


def test_the_readme_says_what_my_engine_returns():
    assert "It returns an `Engine`, the pair `(model, tokenizer)`" in README
    assert 'llmcourse.generate_text(engine, tok, "ROMEO:")' in README


def test_readme_serve_section_runs_as_written(capsys):
    """The server started as the README starts it; its curl commands and its openai examples against it: chat, a
    streamed completion, /tokenize, /detokenize and /metrics (which has counted the two requests before it)."""
    import signal
    import time

    import httpx

    section = README.split("## Serve it")[1].split("\n## ")[0]
    start = next(line.split("  #")[0].strip() for line in section.splitlines() if "python -m llmcourse serve" in line)
    curls = [c.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
             for c in block.replace("\\\n", " ").splitlines() if c.startswith("curl")]  # fmt: skip
    examples = re.findall(r"```python\n(.*?)```", section, flags=re.S)  # the client's, then n and the penalties
    server = subprocess.Popen(["bash", "-c", f"exec {start}"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start (port 8000 taken?)"
            time.sleep(0.1)
        assert httpx.get("http://127.0.0.1:8000/").text.lstrip().lower().startswith("<!doctype html")
        generation = [c for c in curls if "/v1/" in c]
        assert len(generation) == 2
        chat = subprocess.run(["bash", "-c", generation[0]], capture_output=True, text=True, timeout=60)
        reply = __import__("json").loads(chat.stdout)
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"].strip()
        streamed = subprocess.run(["bash", "-c", generation[1]], capture_output=True, text=True, timeout=60)
        events = [line for line in streamed.stdout.splitlines() if line.startswith("data: ")]
        assert len(events) > 5 and events[-1] == "data: [DONE]"
        check_tokens_and_metrics_curls([c for c in curls if "/v1/" not in c], generation_requests=2)
        for example in examples:
            exec(compile(example, "README.md", "exec"), {"__name__": "readme"})
            assert len(capsys.readouterr().out.strip()) > 20
    finally:
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0


def check_tokens_and_metrics_curls(curls: list[str], generation_requests: int) -> None:
    """The README's /tokenize, /detokenize and /metrics commands, run as written against its server: the bundled
    llama-shakespeare's ids and text, and metrics that prometheus_client's parser reads, having counted the
    generation requests run before."""
    import json

    from prometheus_client.parser import text_string_to_metric_families

    from llmcourse.engine.hf_tokenizer import load_tokenizer

    def run(command: str) -> str:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    tokenizer = load_tokenizer("llama-shakespeare")
    prompt, chat, detokenize, metrics = curls
    text = json.loads(re.search(r"-d '(.*)'", prompt).group(1))["prompt"]
    answer = json.loads(run(prompt))
    assert answer["tokens"] == tokenizer.encode(text) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 256 and len(answer["token_strs"]) == answer["count"]
    assert "<|endoftext|>" in answer["token_strs"]  # written in a prompt, the special token is one
    messages = json.loads(re.search(r"-d '(.*)'", chat).group(1))["messages"]
    assert json.loads(run(chat))["tokens"] == tokenizer.encode_chat_plain(messages)
    assert json.loads(run(detokenize)) == {"prompt": messages[0]["content"]}
    families = {f.name: f for f in text_string_to_metric_families(run(metrics))}
    finished = sum(s.value for s in families["llmcourse:request_success"].samples if s.name.endswith("_total"))
    assert finished == generation_requests
    assert families["llmcourse:time_to_first_token_seconds"].type == "histogram"
