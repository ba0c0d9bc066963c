"""The course pipeline: solutions/ -> chapters/ with nbgrader, validation, and the learner tools."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmcourse.course.learner import learner_functions, learner_parts, learner_tokenizer, my_engine
from llmcourse.course.limits import work_seconds
from llmcourse.course.progress import grade_chapter, progress_report, read_chapter

from .release import released

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "solutions").glob("*/*.ipynb"))
CHAPTERS = [s.parent.name for s in SOURCES]


def test_every_chapter_has_a_source_and_a_release():
    assert CHAPTERS[:2] == ["00_pipeline", "01_tokenization"]
    for name in CHAPTERS:
        assert (ROOT / "chapters" / name / f"{name}.ipynb").is_file(), (
            f"chapters/{name} missing: python -m llmcourse release"
        )


@pytest.mark.parametrize("name", CHAPTERS)
def test_release_hides_solutions_and_hidden_tests(name):
    source = json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text())
    release = json.loads((released(name) / f"{name}.ipynb").read_text())
    text = json.dumps(release)
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text
    assert all(not c.get("outputs") for c in release["cells"] if c["cell_type"] == "code")
    chapter = read_chapter(released(name) / f"{name}.ipynb")
    assert chapter.exercises and chapter.setup
    assert all(ex.points > 0 for ex in chapter.exercises)
    # every exercise a stub; chapter 12's checks have no exercise cell of their own (they grade chapters 01-11)
    assert all("raise NotImplementedError()" in ex.source for ex in chapter.exercises if ex.cell is not None)
    # every source cell id survives into the release (stable ids keep the release byte-identical)
    assert [c["id"] for c in source["cells"]] == [c["id"] for c in release["cells"]]


def solved_copy(name: str, folder: Path, solve: int = 10**6) -> Path:
    """A release notebook with the first `solve` exercises filled in from the solutions."""
    release = json.loads((released(name) / f"{name}.ipynb").read_text())
    source = {c["id"]: c for c in json.loads((ROOT / "solutions" / name / f"{name}.ipynb").read_text())["cells"]}
    solved = 0
    for cell in release["cells"]:
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution") and cell["cell_type"] == "code":
            if solved < solve:
                lines = "".join(source[cell["id"]]["source"]).splitlines(keepends=True)
                cell["source"] = [ln for ln in lines if "### BEGIN SOLUTION" not in ln and "### END SOLUTION" not in ln]
            solved += 1
    path = folder / name / f"{name}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(release, indent=1))
    return path


@pytest.mark.parametrize("name", CHAPTERS)
def test_progress_sees_an_untouched_release_as_not_started(name):
    """(Every chapter solved is every point: the course run's `progress submitted/ada`, tests/test_grading.py.)"""
    fresh = grade_chapter(released(name) / f"{name}.ipynb")  # chapter 12's checks grade 01-11, all untouched too
    assert fresh and all(r.status == "not started" and r.points == 0 for r in fresh)


def test_progress_reports_a_failing_exercise_with_its_reason(tmp_path):
    path = solved_copy("00_pipeline", tmp_path)
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["id"] == "top_k_next_tokens-solution":
            # a plausible bug: probabilities of the wrong tokens (forgot to sort)
            cell["source"] = [
                "def top_k_next_tokens(logits, k):\n",
                "    probs = torch.softmax(logits, -1)\n",
                "    return [(i, float(probs[i])) for i in range(k)]\n",
            ]
    path.write_text(json.dumps(nb))
    (result,) = grade_chapter(path)
    assert result.status == "failing" and result.points == 0
    assert "✗ top_k_next_tokens" in result.reason and "expected token" in result.reason
    out = progress(tmp_path)
    assert out.returncode == 0
    assert "00_pipeline: 0/2 points" in out.stdout and "failing: ✗ top_k_next_tokens" in out.stdout
    first_line = result.message.splitlines()[0]
    assert first_line in out.stdout
    assert "expected:" not in out.stdout
    verbose = progress(tmp_path, "--verbose")
    assert "expected:" in verbose.stdout and "got:" in verbose.stdout


def progress(*args):
    return subprocess.run(
        [sys.executable, "-m", "llmcourse", "progress", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_progress_on_a_missing_folder_is_one_clear_error(tmp_path):
    out = progress(tmp_path / "nope")
    assert out.returncode == 2 and "no folder" in out.stderr and "Traceback" not in out.stderr


def test_progress_takes_a_chapter_folder_or_a_notebook_and_says_to_save(tmp_path):
    shutil.copytree(released("00_pipeline"), tmp_path / "00_pipeline")
    for target in [tmp_path, tmp_path / "00_pipeline", tmp_path / "00_pipeline" / "00_pipeline.ipynb"]:
        out = progress(target)
        assert out.returncode == 0, out.stderr
        assert "00_pipeline: 0/2 points" in out.stdout and "· top_k_next_tokens" in out.stdout
        assert "saved notebooks" in out.stdout and "Ctrl+S" in out.stdout
    empty = progress(ROOT / "tests")
    assert empty.returncode == 2 and "no chapter notebooks in" in empty.stderr and "Traceback" not in empty.stderr
    assert "save yours in JupyterLab first" in subprocess.run(
        [sys.executable, "-m", "llmcourse", "progress", "--help"], capture_output=True, text=True
    ).stdout.replace("\n", " ")


def notebook(folder: Path, name: str, *cells) -> Path:
    """A chapter notebook from ("setup" | "code" | "demo", source) and ("exercise" | "check", grade_id, source)."""
    made = []
    for n, (kind, *rest) in enumerate(cells):
        source, meta = rest[-1], {}
        if kind == "setup":
            meta = {"tags": ["setup"]}
        elif kind == "demo":
            meta = {"tags": ["needs-exercise"]}
        elif kind == "exercise":
            meta = {"nbgrader": {"solution": True, "grade": False, "grade_id": rest[0]}}
        elif kind == "check":
            meta = {"nbgrader": {"solution": False, "grade": True, "grade_id": f"{rest[0]}_check", "points": 1}}
        made.append(
            {
                "cell_type": "code",
                "id": f"c{n}",
                "metadata": meta,
                "source": source,
                "outputs": [],
                "execution_count": None,
            }
        )
    made.insert(0, {"cell_type": "markdown", "id": "intro", "metadata": {}, "source": "# A chapter\n\nProse."})
    path = folder / name / f"{name}.ipynb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cells": made, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def statuses(path, **limits):
    return {r.grade_id: (r.status, r.reason) for r in grade_chapter(path, **limits)}


def test_progress_runs_helper_cells_and_keeps_a_broken_cell_to_its_exercise(tmp_path):
    """A helper in a cell of its own counts (as in the notebook); demos do not run; a syntax error, an
    exception, a BaseException or exit() in one exercise fails that exercise only, naming its line."""
    class_panic = "class PanicException(BaseException):\n    pass\n"
    path = notebook(
        tmp_path,
        "05_topic",
        ("setup", "import math\nfrom llmcourse.checks import CheckFailed"),
        ("code", "def helper(x):\n    return x + 1\n\nLIMIT = 3"),  # the learner's own cell
        ("code", "print(1 / 0)"),  # a demo: not run
        ("demo", "LIMIT = helper(None)"),  # tagged needs-exercise: not run
        ("exercise", "uses_helper", "def uses_helper(x):\n    return helper(x) * LIMIT"),
        ("check", "uses_helper", "assert uses_helper(1) == 6, 'uses_helper(1) should be 6'"),
        ("exercise", "typo", "def typo(x):\n    return x +* 2\n"),
        ("check", "typo", "assert typo(1) == 3"),
        ("exercise", "raises", "def raises(x):\n    return x\n\n\nraises(1)\nint('seven')\n"),
        ("check", "raises", "assert raises(1) == 1"),
        ("exercise", "panics", class_panic + "def panics(x):\n    raise PanicException('boom')\n"),
        ("check", "panics", "assert panics(1) == 1"),
        ("exercise", "exits", "def exits(x):\n    exit(3)\n"),
        ("check", "exits", "assert exits(1) == 1"),
        ("exercise", "fine", "def fine(x):\n    return math.sqrt(x)"),
        ("check", "fine", "assert fine(4) == 2"),
        ("exercise", "wordy", "def wordy(x):\n    return x"),
        ("check", "wordy", f"raise CheckFailed('{'long message ' * 12}end\\nsecond line')"),
    )
    report = progress_report(path)
    assert f"failing: {'long message ' * 12}end" in report and "second line" not in report
    assert "second line" in progress_report(path, verbose=True)
    got = statuses(path)
    assert got["uses_helper"] == ("passing", "") and got["fine"] == ("passing", "")
    assert (
        got["typo"][0] == "failing"
        and "SyntaxError" in got["typo"][1]
        and "typo, line 2: `return x +* 2`" in got["typo"][1]
    )
    assert got["raises"][0] == "failing" and got["raises"][1].startswith("your cell raised ValueError")
    assert "raises, line 6: `int('seven')`" in got["raises"][1]
    assert got["panics"][0] == "failing" and "PanicException: boom" in got["panics"][1]
    assert "panics, line 4: `raise PanicException('boom')`" in got["panics"][1]
    assert got["exits"][0] == "failing" and "SystemExit" in got["exits"][1]


def test_progress_bounds_a_hang(tmp_path):
    path = notebook(
        tmp_path,
        "05_topic",
        ("exercise", "loops", "def loops(x):\n    return x\n\nwhile True:\n    pass\n"),
        ("check", "loops", "assert loops(1) == 1"),
        ("exercise", "slow", "def slow(x):\n    while True:\n        pass\n"),
        ("check", "slow", "assert slow(1) == 1"),
        ("exercise", "fine", "def fine(x):\n    return x"),
        ("check", "fine", "assert fine(1) == 1"),
    )
    start = work_seconds()  # CPU time, the checks' child processes included: the same on a busy machine
    got = statuses(path, cell_seconds=1, check_seconds=1)
    assert work_seconds() - start < 5
    assert got["loops"] == ("failing", "your cell was still running after 1 CPU-s (a loop that never ends?)")
    assert got["slow"][0] == "failing" and "still running after 1 CPU-s" in got["slow"][1]
    assert got["fine"] == ("passing", "")


def test_progress_chapter_limit_holds_through_the_checks_own_limits(tmp_path):
    """The chapter's overall limit is not switched off by the per-call limit inside a check."""
    path = notebook(
        tmp_path,
        "05_topic",
        ("setup", "import time\nfrom llmcourse.checks import Case, run_check"),
        (
            "exercise",
            "slow",
            "def slow(x):\n    end = time.process_time() + 0.3\n"
            "    while time.process_time() < end:\n        pass\n    return x",
        ),
        ("check", "slow", "run_check('slow', slow, [Case(str(i), (i,), i) for i in range(30)])"),
        ("exercise", "later", "def later(x):\n    return x"),
        ("check", "later", "assert later(1) == 1"),
    )
    start = work_seconds()
    got = statuses(path, chapter_seconds=2)
    assert work_seconds() - start < 4
    assert got["slow"][0] == "failing" and got["later"][0] == "failing"
    assert "used more than the 2 CPU-s allowed" in got["later"][1]


def test_an_exercise_needing_an_unwritten_one_says_so(tmp_path):
    """encode written, bpe_encode_chunk still a stub: progress and the engine both name the stub;
    the engine falls back to its own encode with one notice, and generation works."""
    path = solved_copy("01_tokenization", tmp_path)
    nb = json.loads(path.read_text())
    release = {
        c["id"]: c for c in json.loads((released("01_tokenization") / "01_tokenization.ipynb").read_text())["cells"]
    }
    for cell in nb["cells"]:
        if cell["id"] == "chunk-solution":
            cell["source"] = release[cell["id"]]["source"]
    path.write_text(json.dumps(nb))
    got = statuses(path)
    assert got["bpe_encode_chunk"] == ("not started", "")
    assert got["encode"][0] == "failing" and "it uses bpe_encode_chunk, which is not written yet" in got["encode"][1]
    assert got["decode"] == ("passing", "") and got["stream_decoder"] == ("passing", "")
    notices = []
    tokenizer = learner_tokenizer(tmp_path, notify=notices.append)
    assert set(tokenizer.mine) == {"decode", "StreamDecoder"}
    assert [n for n in notices if "encode" in n and "engine's encode" in n] == [
        "01_tokenization: encode does not pass its check (it uses bpe_encode_chunk, which is not written yet: "
        "write the exercise 'bpe_encode_chunk' first); the engine's encode runs instead"
    ]
    assert not any("bpe_encode_chunk runs" in n or "train_bpe" in n for n in notices), "only exercises with a slot"
    assert tokenizer.encode("ROMEO: café") == __import__("llmcourse").get_tokenizer().encode("ROMEO: café")


def test_learner_functions_are_those_whose_checks_pass(tmp_path):
    notices = []
    shutil.copytree(released("00_pipeline"), tmp_path / "00_pipeline")
    assert learner_functions(tmp_path, notify=notices.append) == {}
    assert notices == [], "top_k_next_tokens has no slot in the engine: no notice"
    solved_copy("00_pipeline", tmp_path)
    functions = learner_functions(tmp_path, notify=notices.append)
    assert list(functions) == ["top_k_next_tokens"]
    assert functions["top_k_next_tokens"](__import__("torch").tensor([0.0, 1.0]), 1)[0][0] == 1


GELU = (
    "def gelu(x):\n    CALLS.append(1)\n    return 0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))"
)


def test_learner_parts_plug_into_the_engine(tmp_path):
    """A learner's gelu, written in a chapter notebook, runs inside the model."""
    notebook(
        tmp_path,
        "04_block",
        ("setup", "import torch\nCALLS = []"),
        ("exercise", "gelu", GELU),
        ("check", "gelu", "assert abs(float(gelu(torch.tensor(1.0))) - 0.8412) < 1e-3"),
    )
    import torch

    from llmcourse import GPT2, GPT2Config

    notices = []
    parts = learner_parts(tmp_path, notify=notices.append)
    assert parts.overridden() == ["gelu"] and notices == ["parts: yours for gelu; the engine's for the rest"]
    model = GPT2(GPT2Config(n_layer=2, n_head=2, n_embd=16, n_positions=8, vocab_size=50)).init_weights(0)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        reference = model(ids)
        model.parts = parts
        mine = model(ids)
    assert torch.allclose(mine, reference, atol=1e-5)
    assert model.parts.gelu.__wrapped__.__globals__["CALLS"] == [1, 1, 1]  # once in its check, once per layer


def test_a_part_failing_its_check_is_not_used(tmp_path):
    notebook(
        tmp_path,
        "04_block",
        ("setup", "import torch\nCALLS = []"),
        ("exercise", "gelu", GELU.replace("0.5 * x", "0.4 * x")),
        ("check", "gelu", "assert abs(float(gelu(torch.tensor(1.0))) - 0.8412) < 1e-3, 'gelu(1.0) should be 0.8412'"),
    )
    notices = []
    assert learner_parts(tmp_path, notify=notices.append).overridden() == []
    assert notices == [
        "04_block: gelu does not pass its check (the check raised AssertionError: gelu(1.0) should be 0.8412 "
        f"({tmp_path.name}/04_block: gelu check, line 1: `assert abs(float(gelu(torch.tensor(1.0))) - 0.8412) < 1e-3, "
        "'gelu(1.0) should be 0.8412'`)); the engine's gelu runs instead",
        "parts: yours for none yet; the engine's for the rest",
    ]


def test_notices_and_the_engine_report_agree_in_number_with_the_functions_they_name(tmp_path):
    """An exercise of two functions (chapter 09's) falls back to "the engine's quantize_int8 and dequantize_int8
    run instead", one to "the engine's int8_linear runs instead"; the report says a reason of the functions it
    lists: "are not written yet" for two, "is missing" for one."""
    from llmcourse.course.learner import engine_report, pieces_of, your_pieces

    def check(name, call, message):  # a failing check, and how the notice names it
        line = f"assert {call} == 2, {message!r}"
        where = f"{tmp_path.name}/09_quantization: {name} check, line 1: `{line}`"
        return ("check", name, line), f"the check raised AssertionError: {message} ({where})"

    pack_check, pack_fails = check("pack_int4", "pack_int4(1)", "two 4-bit values per byte")
    linear_check, linear_fails = check("int8_linear", "int8_linear(1, 2, 3, 4)", "not the integer sums")
    notebook(
        tmp_path,
        "09_quantization",
        ("exercise", "quantize_int8", "def quantize_int8(w):\n    raise NotImplementedError\n\n\n"
                                      "def dequantize_int8(q, scale):\n    raise NotImplementedError"),
        ("check", "quantize_int8", "quantize_int8(None)"),
        ("exercise", "pack_int4", "def pack_int4(q):\n    return q\n\n\ndef unpack_int4(packed):\n    return packed"),
        pack_check,
        ("exercise", "quantize_int4", "def quantize_int4(w):\n    return w\n\n\ndef dequantize_int4(q):\n    return q"),
        ("check", "quantize_int4", "assert quantize_int4(1) == 1"),
        ("exercise", "int8_linear", "def int8_linear(x, q, scale, bias):\n    return x"),
        linear_check,
    )  # fmt: skip
    notices = []
    pieces = your_pieces(tmp_path, notify=notices.append)
    assert notices == [
        "09_quantization: quantize_int8 is not written yet; the engine's quantize_int8 and dequantize_int8 run instead",
        f"09_quantization: pack_int4 does not pass its check ({pack_fails}); the engine's pack_int4 and unpack_int4 "
        "run instead",
        f"09_quantization: int8_linear does not pass its check ({linear_fails}); the engine's int8_linear runs instead",
        "your engine: your quantize_int4, dequantize_int4 (quantizing); the engine's own for the rest",
    ]
    report = engine_report(pieces).splitlines()
    assert next(line for line in report if line.startswith("09_")) == (
        "09_quantization  yours: quantize_int4, dequantize_int4; the engine's: quantize_int8, dequantize_int8 (are not "
        f"written yet); the engine's: pack_int4, unpack_int4 (do not pass their check ({pack_fails})); the engine's: "
        f"int8_linear (does not pass its check ({linear_fails}))"
    )
    here = f".ipynb in {tmp_path})"
    assert (
        report[1]
        == "02_embeddings    the engine's: embedding, rope (are missing: no 02_embeddings/02_embeddings" + here
    )
    assert report[5] == "06_kv_cache      the engine's: KVCache (is missing: no 06_kv_cache/06_kv_cache" + here
    unknown = engine_report(pieces_of({}, notify=lambda line: None)).splitlines()
    assert unknown[1] == "02_embeddings    the engine's: embedding, rope (their notebook was not found)"
    assert unknown[5] == "06_kv_cache      the engine's: KVCache (its notebook was not found)"


def test_my_engine_uses_every_passing_slot_and_notifies_once(tmp_path, small_pair):
    """Chapters 00 and 01 untouched, plus a gelu: one notice per unwritten slot exercise (none for
    exercises without a slot), and the engine runs, the same text as the engine's own."""
    import llmcourse
    from llmcourse import generate_text, get_tokenizer

    for name in ("00_pipeline", "01_tokenization"):
        shutil.copytree(released(name), tmp_path / name)
    notebook(
        tmp_path,
        "04_block",
        ("setup", "import torch\nCALLS = []"),
        ("exercise", "gelu", GELU),
        ("check", "gelu", "assert gelu(torch.tensor([0.0])).tolist() == [0.0]"),
    )
    notices = []
    model = small_pair[0]
    engine = my_engine(tmp_path, model=model, notify=notices.append)
    try:
        assert notices == [
            "01_tokenization: encode is not written yet; the engine's encode runs instead",
            "01_tokenization: decode is not written yet; the engine's decode runs instead",
            "01_tokenization: stream_decoder is not written yet; the engine's StreamDecoder runs instead",
            "your engine: your gelu (every generation with GPT-2); the engine's own for the rest",
        ]
        mine = engine.generate_text("ROMEO: 🦙", max_new_tokens=20, eos_token_id=None)
    finally:
        model.parts = llmcourse.Parts()  # the only table a model holds: the learner's gelu is in it
    assert mine == generate_text(model, get_tokenizer(), "ROMEO: 🦙", max_new_tokens=20, eos_token_id=None)


def test_a_learner_function_failing_in_the_engine_falls_back_naming_its_line(tmp_path):
    """A tokenizer function that passes its check but raises on some input: the engine's takes over,
    one notice names the cell and the line; the stream decoder catches up mid-stream."""
    from llmcourse import get_tokenizer

    notebook(
        tmp_path,
        "01_tokenization",
        ("setup", "import llmcourse\nreference = llmcourse.get_tokenizer()"),
        (
            "exercise",
            "encode",
            "def encode(text, ranks):\n    if 'x' in text:\n        raise KeyError(text)\n"
            "    return reference.encode(text, allowed_special='all')",
        ),
        ("check", "encode", "assert encode('ab', None) == [397]"),
        (
            "exercise",
            "stream_decoder",
            "class StreamDecoder:\n    def __init__(self, vocab):\n        self.vocab, self.n = vocab, 0\n\n"
            "    def push(self, token_id):\n        self.n += 1\n        assert self.n < 3, 'tired'\n"
            "        return self.vocab[token_id].decode()\n\n    def flush(self):\n        return ''\n",
        ),
        ("check", "stream_decoder", "assert StreamDecoder({1: b'a'}).push(1) == 'a'"),
    )
    notices = []
    tokenizer = learner_tokenizer(tmp_path, notify=notices.append)
    assert set(tokenizer.mine) == {"encode", "StreamDecoder"}
    assert tokenizer.encode("ab") == [397]
    assert tokenizer.encode("xy") == get_tokenizer().encode("xy") and "encode" not in tokenizer.mine
    assert (
        f"your encode raised KeyError: 'xy' ({tmp_path.name}/01_tokenization: encode, line 3: `raise KeyError(text)`); "
        "the engine's encode runs from now on" in notices
    )
    decoder = tokenizer.stream_decoder()
    ids = get_tokenizer().encode("one two 🦙 three")
    text = "".join(decoder.push(i) for i in ids) + decoder.flush()
    assert text == "one two 🦙 three"
    assert sum("your StreamDecoder raised AssertionError: tired" in n for n in notices) == 1


def test_learner_tokenizer_runs_generation_with_the_learners_chapter_01(tmp_path, small_pair):
    from llmcourse import generate_text, get_tokenizer

    model = small_pair[0]
    prompt = "ROMEO: 🦙 café"
    notices = []
    shutil.copytree(released("01_tokenization"), tmp_path / "01_tokenization")
    untouched = learner_tokenizer(tmp_path, notify=notices.append)
    assert (
        untouched.mine == {}
        and "01_tokenization: encode is not written yet; the engine's encode runs instead" in notices
    )
    solved_copy("01_tokenization", tmp_path)
    notices.clear()
    mine = learner_tokenizer(tmp_path, notify=notices.append)
    assert set(mine.mine) == {"encode", "decode", "StreamDecoder"}
    assert notices == ["tokenizer: yours for StreamDecoder, decode, encode; the engine's for the rest"]
    assert mine.encode(prompt) == get_tokenizer().encode(prompt)
    expected = generate_text(model, get_tokenizer(), prompt, max_new_tokens=30, eos_token_id=None)
    assert generate_text(model, mine, prompt, max_new_tokens=30, eos_token_id=None) == expected


def test_a_cell_calling_my_engine_is_not_run_again_by_it(tmp_path):
    """`engine = my_engine()` alone in a cell only defines a name, so progress and my_engine run it;
    it must not run the notebooks again (endlessly): that cell fails on its own, the rest is fine."""
    path = notebook(
        tmp_path,
        "05_topic",
        ("setup", "from llmcourse.course.learner import my_engine"),
        ("code", "engine = my_engine()"),
        ("exercise", "greedy", "def greedy(logits):\n    return logits.argmax(-1)"),  # a slot: my_engine reads 05
        ("check", "greedy", "assert greedy(__import__('torch').tensor([0.0, 1.0])) == 1"),
        ("exercise", "uses_engine", "def uses_engine():\n    return engine"),
        ("check", "uses_engine", "assert uses_engine() is not None"),
    )
    got = statuses(path)
    assert got["greedy"] == ("passing", "")
    assert got["uses_engine"][0] == "failing" and "cannot run 05_topic again" in got["uses_engine"][1]
    assert "cell 2" in got["uses_engine"][1]


def test_the_solved_chapters_02_to_04_run_the_engine_on_every_part(tmp_path):
    """Chapters 02–04 solved as their solutions solve them: every slot of the engine is the learner's,
    the logits stay within 1e-4 of the engine's own and greedy decoding gives the same tokens."""
    import torch

    import llmcourse
    from llmcourse.course.learner import LLAMA_PARTS, PART_SLOTS

    for name in ("02_embeddings", "03_attention", "04_gpt2"):
        solved_copy(name, tmp_path)
    notices = []
    parts = learner_parts(tmp_path, notify=notices.append)
    gpt2_slots = [n for n in PART_SLOTS if n not in LLAMA_PARTS or n == "rope"]  # chapter 02's rope; 11 does the rest
    assert sorted(parts.overridden()) == sorted(gpt2_slots), notices
    engine = llmcourse.load_model(device="cpu")
    mine = llmcourse.load_model(device="cpu", parts=parts)
    prompt = llmcourse.get_tokenizer().encode("ROMEO:\nWhat light through yonder window breaks?")
    with torch.inference_mode():
        difference = (mine(torch.tensor([prompt])) - engine(torch.tensor([prompt]))).abs().max().item()
    assert difference < 1e-4
    assert llmcourse.generate(mine, prompt, max_new_tokens=40) == llmcourse.generate(engine, prompt, max_new_tokens=40)


def test_the_solved_chapter_03_merges_llmengines_partitions_with_the_learners_merge_attention(tmp_path):
    """Chapter 03 solved as its solution solves it: its merge_attention is LLMEngine's (a Batching slot), and with
    contexts split into partitions of 8 positions the engine gives generate's tokens."""
    import llmcourse
    from llmcourse.course.learner import your_pieces

    solved_copy("03_attention", tmp_path)
    notices = []
    pieces = your_pieces(tmp_path, notify=notices.append)
    assert pieces.functions["batching"].overridden() == ["merge_attention"], notices
    model = pieces.install(llmcourse.load_model(device="cpu"))  # an Engine: LLMEngine runs the learner's merge
    tok = llmcourse.get_tokenizer()
    prompts = [tok.encode(p) for p in ("ROMEO:\nBut, soft!", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?")]
    alone = [llmcourse.generate(model, p, max_new_tokens=20) for p in prompts]
    engine = llmcourse.LLMEngine(model, block_size=4, partition_size=8)
    assert engine.batching.merge_attention is pieces.functions["batching"].merge_attention
    assert engine.generate(prompts, max_new_tokens=20) == alone


def test_the_solved_chapters_05_and_06_run_the_engine_with_the_learners_sampler_and_cache(tmp_path):
    """Chapters 05–06 solved as their solutions solve them: the engine's sampler functions and KV cache
    are the learner's, and the engine gives the same tokens as its own, greedy and sampled (same seed)."""
    import llmcourse
    from llmcourse.course.guards import GuardedCache
    from llmcourse.course.learner import SAMPLER_SLOTS, your_pieces

    for name in ("05_sampling", "06_kv_cache"):
        solved_copy(name, tmp_path)
    notices = []
    pieces = your_pieces(tmp_path, notify=notices.append)
    assert sorted(pieces.functions["sampler"].overridden()) == sorted(SAMPLER_SLOTS), notices
    engine = llmcourse.load_model(device="cpu")
    mine = pieces.install(llmcourse.load_model(device="cpu"))  # an Engine: its generation runs the learner's
    assert isinstance(mine.model.new_cache(1, 8, cache_class=mine.functions["kv_cache"]), GuardedCache)
    prompts = [llmcourse.get_tokenizer().encode(p) for p in ("ROMEO:", "JULIET:\nO Romeo, Romeo!")]
    for settings in (
        dict(),
        dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.2, seed=5),
        dict(num_beams=3),
    ):
        expected = llmcourse.generate(engine, prompts, max_new_tokens=30, **settings)
        assert llmcourse.generate(mine, prompts, max_new_tokens=30, **settings) == expected, settings


def test_the_solved_chapter_07_runs_llmengine_with_the_learners_batching_functions(tmp_path):
    """Chapter 07 solved as its solution solves it: all five batching functions are the learner's, and
    LLMEngine (paged, continuously batched, prefix-cached through the learner's block_hashes, preempting, its
    decode attention the learner's paged_attention over partitions of 16 positions) gives the tokens the
    engine's own functions give, which are those of `generate` alone."""
    import llmcourse
    from llmcourse.course.learner import BATCHING_SLOTS, your_pieces

    solved_copy("07_batching", tmp_path)
    notices = []
    pieces = your_pieces(tmp_path, notify=notices.append)
    theirs = pieces.functions["batching"].overridden() + (["left_pad"] if "left_pad" in pieces.functions else [])
    assert sorted(theirs) == sorted(n for n in BATCHING_SLOTS if n != "merge_attention"), notices  # that's 03's
    model = llmcourse.load_model(device="cpu")
    tok = llmcourse.get_tokenizer()
    system = tok.encode(
        "KING HENRY:\nNow, lords, for France; the enterprise whereof\nShall be to you, as us, like glorious."
    )
    prompts = [system + tok.encode(p) for p in ("\nROMEO:", "\nJULIET:", "\nHAMLET: To be")] + [tok.encode("ROMEO:")]
    settings = [dict(), dict(temperature=0.8, top_p=0.95, seed=3), dict(max_new_tokens=9), dict(repetition_penalty=1.3)]
    alone = [llmcourse.generate(model, p, **{"max_new_tokens": 24, **s}) for p, s in zip(prompts, settings)]
    model = pieces.install(model)  # an Engine: LLMEngine and generate run the learner's functions
    engine = llmcourse.LLMEngine(
        model, block_size=8, num_blocks=10, max_num_seqs=3, max_num_batched_tokens=20, partition_size=16
    )
    assert engine.generate(prompts, arrivals=[0, 1, 1, 4], settings=settings, max_new_tokens=24) == alone
    assert engine.stats["cached_tokens"] > 0 and engine.stats["preemptions"] > 0, engine.stats
    static = llmcourse.generate(model, prompts[:3], max_new_tokens=24)  # the learner's left_pad
    assert static == [llmcourse.generate(model, p, max_new_tokens=24) for p in prompts[:3]]


def test_the_solved_chapter_08_runs_speculative_decoding_with_the_learners_functions(tmp_path):
    """Chapter 08 solved as its solution solves it: all five speculative decoding functions are the
    learner's; greedy speculative decoding with the draft model (the learner's round) and with prompt
    lookup (the learner's lookup and verify) gives plain greedy's tokens, also with num_draft_tokens="auto"
    (the learner's best_k chooses k), and sampling (the learner's acceptance rule) runs."""
    import llmcourse
    from llmcourse.course.learner import SPECULATION_SLOTS, your_pieces
    from llmcourse.engine.speculative import SpeculationStats, best_k

    solved_copy("08_speculative", tmp_path)
    notices = []
    pieces = your_pieces(tmp_path, notify=notices.append)
    assert sorted(pieces.functions["speculation"].overridden()) == sorted(SPECULATION_SLOTS), notices
    model = llmcourse.load_model(device="cpu")
    draft = llmcourse.load_model("gpt2-shakespeare-draft", device="cpu")
    tok = llmcourse.get_tokenizer()
    prompts = [tok.encode("ROMEO:"), tok.encode("To be, or not to be, that is the question. To be, or not")]
    plain = [llmcourse.generate(model, p, max_new_tokens=30) for p in prompts]
    model = pieces.install(model)  # an Engine: generate runs the learner's speculative decoding
    for proposer in (draft, "prompt-lookup"):
        stats = SpeculationStats()
        assert (
            llmcourse.generate(model, prompts, max_new_tokens=30, draft=proposer, num_draft_tokens=3, stats=stats)
            == plain
        )
        assert stats.new_tokens == 60 and len(stats.rounds) < 60, stats.summary()
    stats = SpeculationStats()
    assert (
        llmcourse.generate(model, prompts, max_new_tokens=30, draft=draft, num_draft_tokens="auto", stats=stats)
        == plain
    )
    assert stats.choices and all(c.k == best_k(c.alpha, c.c, 8) for c in stats.choices), stats.choices
    sampled = llmcourse.generate(model, prompts[0], max_new_tokens=30, draft=draft, temperature=0.8, seed=5)
    assert sampled == llmcourse.generate(model, prompts[0], max_new_tokens=30, draft=draft, temperature=0.8, seed=5)


def test_the_solved_chapter_09_quantizes_the_engines_model_with_the_learners_functions(tmp_path):
    """Chapter 09 solved as its solution solves it: all eight quantization functions are the learner's; a model
    quantized with them holds exactly the engine's bytes (int8 and int4), and running with the learner's int8 layer
    (the integer route) and int4 dequantizer gives the tokens of the engine's reference functions and logits close to
    the engine's fast routes (int8: the same integer sums; int4: the activations rounded to int8 too); smoothed with a
    calibration, the learner's smooth_scales gives the engine's bytes."""
    import llmcourse
    from llmcourse.course.guards import guarded
    from llmcourse.course.learner import QUANTIZATION_SLOTS, your_pieces
    from llmcourse.engine import quantize

    solved_copy("09_quantization", tmp_path)
    notices = []
    pieces = your_pieces(tmp_path, notify=notices.append)
    assert sorted(pieces.quantization.overridden()) == sorted(QUANTIZATION_SLOTS), notices
    prompt = llmcourse.get_tokenizer().encode("ROMEO:")
    for fmt in ("int8", "int4"):
        fast = llmcourse.load_model(device="cpu", quantize=fmt)
        reference = llmcourse.load_model(device="cpu")  # the reference functions, guarded like a learner's
        references = guarded(
            quantize.Quantization, int8_linear=quantize.int8_linear, dequantize_int4=quantize.dequantize_int4
        )
        quantize.quantize_model(reference, fmt, references)
        mine = pieces.install(llmcourse.load_model(device="cpu"), fmt).model
        theirs = dict(fast.named_buffers())
        for name, tensor in mine.named_buffers():
            assert torch.equal(tensor, theirs[name]), (fmt, name)
        assert llmcourse.generate(mine, prompt, max_new_tokens=30) == llmcourse.generate(
            reference, prompt, max_new_tokens=30
        )
        ids = torch.tensor([prompt + llmcourse.generate(fast, prompt, max_new_tokens=30)])
        error = (mine(ids) - fast(ids)).abs().max() / fast(ids).abs().max()
        assert error < 0.03, (fmt, error)  # measured 0.004 (int8), 0.013 (int4)
    calibration = prompt + llmcourse.generate(fast, prompt, max_new_tokens=30)
    mine = quantize.quantize_model(
        llmcourse.load_model(device="cpu"), "int8", pieces.quantization, calibration=calibration
    )
    theirs = quantize.quantize_model(llmcourse.load_model(device="cpu"), "int8", calibration=calibration)
    for (name, tensor), (_, expected) in zip(mine.named_buffers(), theirs.named_buffers()):
        assert torch.equal(tensor, expected), name


def test_the_solved_chapter_13_constrains_generation_with_the_learners_functions(tmp_path, capsys, monkeypatch):
    """Chapter 13 solved as its solution solves it: all four structured-output functions are the learner's; under a
    regex the learner's walk, index and mask give the engine's own tokens (greedy and sampled); under a schema of the
    chapter's subset the learner's regex makes JSON that validates; `generate --parts --choice` prints what the
    engine alone prints and says the learner's functions ran."""
    import jsonschema

    import llmcourse
    from llmcourse.__main__ import main
    from llmcourse.course.learner import ENGINE_SLOTS, STRUCTURING_SLOTS, pieces_of, your_pieces
    from llmcourse.engine.structured.constraint import compile_constraint

    solved_copy("13_structured", tmp_path)
    notices = []
    assert your_pieces(tmp_path, notify=notices.append).structuring.overridden() == []  # the core path's alone
    pieces = your_pieces(tmp_path, notify=notices.append, beyond=True)
    assert sorted(pieces.structuring.overridden()) == sorted(STRUCTURING_SLOTS), notices
    model, tok = llmcourse.load_model(device="cpu"), llmcourse.get_tokenizer()
    prompt = tok.encode("ROMEO:")
    for settings in (dict(), dict(temperature=0.9, seed=3)):  # greedy and sampled
        mine, theirs = (
            llmcourse.generate(model, prompt, max_new_tokens=12, eos_token_id=50256, **settings,
                               constraint=compile_constraint(tok, regex=r"[a-z]+(?:, [a-z]+){0,3}\\.", structuring=s))
            for s in (pieces.structuring, None)
        )  # fmt: skip
        assert mine == theirs, settings
    schema = {"type": "object", "properties": {"who": {"type": "string", "maxLength": 10}, "n": {"type": "integer"},
              "ok": {"type": "boolean"}}, "required": ["who", "n", "ok"], "additionalProperties": False}  # fmt: skip
    constraint = compile_constraint(tok, json_schema=schema, structuring=pieces.structuring)
    out = llmcourse.generate(model, prompt, max_new_tokens=60, eos_token_id=50256, constraint=constraint)
    jsonschema.validate(json.loads(tok.decode(out[: out.index(50256)])), schema)
    # the server with the learner's engine (`serve --parts`): a guided regex compiled with their four functions
    import openai

    from llmcourse.serving.api_server import ServerThread, build_app
    from llmcourse.serving.llm_engine import LLMEngine

    engine = pieces.engine(model)
    regex = r"[a-z]+(?:, [a-z]+){0,3}\\."
    alone = tok.decode(
        llmcourse.generate(
            model, prompt, max_new_tokens=12, eos_token_id=50256, constraint=compile_constraint(tok, regex=regex)
        )  # fmt: skip
    )
    llm = LLMEngine(engine, max_num_seqs=4, tokenizer=engine.tokenizer)
    app = build_app(llm, engine.tokenizer, "mine", structuring=pieces.structuring)
    with ServerThread(app) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(
            model="mine", prompt="ROMEO:", max_tokens=12, temperature=0, extra_body={"guided_regex": regex}
        )
    assert reply.choices[0].text == alone.removesuffix("<|endoftext|>"), (reply.choices[0].text, alone)
    assert app.state.server.structuring is pieces.structuring
    args = ["generate", "--choice", "yes", "no", "--max-new-tokens", "4", "Is Juliet a Capulet?"]
    assert main(args) == 0
    alone = capsys.readouterr().out
    asked = []  # (the chapter has run once above: the command gets those pieces, and must ask for chapter 13)

    def read_once(folder, **settings):
        asked.append(settings.get("beyond"))
        return pieces_of(pieces.mine, notify=settings["notify"], uses=settings["uses"], read=ENGINE_SLOTS)

    monkeypatch.setattr("llmcourse.__main__.your_pieces", read_once)
    assert main([*args[:1], "--parts", str(tmp_path), *args[1:]]) == 0 and asked == [True]
    captured = capsys.readouterr()
    assert captured.out == alone and captured.out.strip() in ("yes", "no")
    assert "your walk_token, token_index, mask_logits" in captured.err, captured.err


def test_the_chapters_folder_is_found_from_a_notebook_in_the_folder_or_under_autograde(tmp_path, monkeypatch):
    """From chapters/NN/ the folder above; from the course root ./chapters; and where `nbgrader autograde` runs a
    notebook (autograded/STUDENT/CHAPTER/), the student's collected chapters in submitted/STUDENT/ — autograded/
    holds only what was graded so far."""
    from llmcourse.course.progress import default_folder

    for folder in ("chapters/12_capstone", "submitted/ada/12_capstone", "submitted/ada/03_attention",
                   "autograded/ada/12_capstone"):  # fmt: skip
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / f"{Path(folder).name}.ipynb").write_text("{}")
    monkeypatch.chdir(tmp_path / "chapters" / "12_capstone")
    assert default_folder().resolve() == (tmp_path / "chapters").resolve()
    monkeypatch.chdir(tmp_path)
    assert default_folder() == Path("chapters")
    monkeypatch.chdir(tmp_path / "autograded" / "ada" / "12_capstone")
    assert default_folder().resolve() == (tmp_path / "submitted" / "ada").resolve()
    shutil.rmtree(tmp_path / "submitted")  # not collected: the folder above, as anywhere else
    assert default_folder().resolve() == (tmp_path / "autograded" / "ada").resolve()


def test_the_capstone_names_a_chapter_that_is_missing(tmp_path):
    """Chapter 12 reads the other chapters from the folder (under nbgrader autograde: the student's handed-in
    notebooks); a chapter that is not there is named, with where it was looked for, in the engine's report and in
    every check that needs it."""
    from llmcourse.checks.capstone import check_mode
    from llmcourse.course.failed import CheckFailed
    from llmcourse.course.learner import engine_report, your_pieces

    notebook(
        tmp_path,
        "05_sampling",
        ("exercise", "greedy", "def greedy(logits):\n    return logits.argmax(-1)"),
        ("check", "greedy", "assert greedy(__import__('torch').tensor([0.0, 1.0])) == 1"),
    )
    pieces = your_pieces(tmp_path, notify=lambda line: None)
    assert pieces.mine == {"greedy": pieces.mine["greedy"]}
    missing = f"missing: no 02_embeddings/02_embeddings.ipynb in {tmp_path}"
    assert f"02_embeddings    the engine's: embedding, rope (are {missing})" in engine_report(pieces).splitlines()
    with pytest.raises(CheckFailed) as err:
        check_mode("batched", pieces)
    assert f"  02_embeddings (embedding, rope): {missing}\n" in str(err.value)
    assert "hint: finish 02_embeddings, 03_attention, 04_gpt2" in str(err.value)


def test_progress_grades_chapter_12_on_the_chapters_it_finds(tmp_path):
    """A check cell with no exercise of its own (chapter 12's) is graded as one: its cells may read the other
    chapters (not their own again), from the chapter's folder as a kernel would."""
    notebook(
        tmp_path,
        "05_sampling",
        ("exercise", "greedy", "def greedy(logits):\n    return logits.argmax(-1)"),
        ("check", "greedy", "assert greedy(__import__('torch').tensor([0.0, 1.0])) == 1"),
    )
    notebook(
        tmp_path,
        "12_capstone",
        ("setup", "from llmcourse.course.learner import your_pieces"),
        ("code", "pieces = your_pieces(notify=lambda line: None)"),
        ("check", "mine", "assert sorted(pieces.mine) == ['greedy']"),
        ("check", "all", "assert 'top_k' in pieces.mine, 'write top_k'"),
    )
    report = progress_report(tmp_path)
    assert "12_capstone: 1/2 points" in report and "✓ mine_check" in report
    assert "✗ all_check" in report and "write top_k" in report


def test_progress_shows_the_capstone_not_started_then_failing_with_no_dangling_colon(tmp_path):
    """The real chapter 12 beside untouched chapters: each mode 'not started', as other chapters say it. Once the
    learner has written something (chapter 00 solved), each mode fails with its first line whole (the list of
    functions still the engine's own, after its colon, is --verbose's) and no line ends with a colon."""
    for name in ("00_pipeline", "05_sampling", "12_capstone"):
        shutil.copytree(released(name), tmp_path / name)
    modes = ["single", "batched", "llm_engine", "speculative", "int8", "int4", "sampled"]
    points = dict(single=3, batched=2, llm_engine=3, speculative=3, int8=2, int4=2, sampled=2)
    untouched = progress_report(tmp_path).splitlines()
    assert untouched[untouched.index("12_capstone: 0/17 points") + 1 :] == [
        f"  · {'capstone_' + mode:<22} {'0/' + str(points[mode]):>5}  not started" for mode in modes
    ] + ["total: 0/39 points"]
    solved_copy("00_pipeline", tmp_path)
    started = progress_report(tmp_path).splitlines()
    assert started[started.index("12_capstone: 0/17 points") + 1 :] == [
        f"  ✗ {'capstone_' + mode:<22} {'0/' + str(points[mode]):>5}  failing: ✗ capstone {mode} — this mode runs "
        "functions that are still the engine's own (--verbose shows which)"
        for mode in modes
    ] + ["total: 2/39 points"]
    verbose = progress_report(tmp_path, verbose=True)
    assert f"{'':34}  05_sampling (greedy): not written yet" in verbose.splitlines()
    assert not [line for line in started + verbose.splitlines() if line.endswith(":")]


def test_a_check_of_the_whole_course_is_not_started_until_an_exercise_is_written(tmp_path, monkeypatch):
    """A check cell with no exercise of its own (chapter 12's) is 'not started' while every exercise of the other
    chapters in the folder is still its stub, and graded from the first one written; the folder given as a relative
    path too (`progress chapters/`)."""
    stub = ("exercise", "greedy", "def greedy(logits):\n    raise NotImplementedError")
    notebook(tmp_path, "05_sampling", stub, ("check", "greedy", "greedy(None)"))
    notebook(
        tmp_path,
        "12_capstone",
        ("setup", "from llmcourse.course.learner import learner_functions"),
        ("check", "greedy_yours", "assert 'greedy' in learner_functions(notify=print), 'write greedy'"),
    )
    assert statuses(tmp_path / "12_capstone" / "12_capstone.ipynb") == {"greedy_yours_check": ("not started", "")}
    monkeypatch.chdir(tmp_path.parent)
    assert "  · greedy_yours_check       0/1  not started" in progress_report(tmp_path.name).splitlines()
    written = ("exercise", "greedy", "def greedy(logits):\n    return 1")
    notebook(tmp_path, "05_sampling", written, ("check", "greedy", "assert greedy(None) == 1"))
    assert statuses(tmp_path / "12_capstone" / "12_capstone.ipynb") == {"greedy_yours_check": ("passing", "")}


@pytest.mark.parametrize("folder", ["solutions", "chapters"])
def test_cell_ids_are_unique_in_every_notebook(folder):
    for path in sorted((ROOT / folder).glob("*/*.ipynb")):
        ids = [c["id"] for c in json.loads(path.read_text())["cells"]]
        assert len(ids) == len(set(ids)), f"{path.name}: {sorted({i for i in ids if ids.count(i) > 1})}"
