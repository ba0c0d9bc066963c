"""A learner working in this checkout: `python -m pytest -q` (the README's contributors' command) tests the release
as generated, not the learner's edited `chapters/` (issue 22: their finished exercises were XPASS(strict) failures).
The course run (tests/course_run.py) releases the chapters from solutions/ into a scratch course and runs those;
the one test that reads the committed chapters/ against them skips a chapter holding a learner's work, saying why
(tests/test_notebooks.py)."""

import json
import shutil
from pathlib import Path

from .release import generated, learner_work, released
from .test_course import solved_copy

ROOT = Path(__file__).resolve().parent.parent


def test_an_untouched_release_is_the_release(tmp_path):
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        name = path.parent.name
        if learner_work(ROOT / "chapters" / name / f"{name}.ipynb") is None:
            assert released(name) == ROOT / "chapters" / name
    copy = tmp_path / "00_pipeline"
    shutil.copytree(released("00_pipeline"), copy)
    assert learner_work(copy / "00_pipeline.ipynb") is None


def test_the_release_regenerated_for_a_learner_is_the_committed_one():
    assert (generated("00_pipeline") / "00_pipeline.ipynb").read_bytes() == (
        ROOT / "chapters" / "00_pipeline" / "00_pipeline.ipynb"
    ).read_bytes()


def test_a_learners_edits_and_outputs_are_their_work(tmp_path):
    solved = solved_copy("00_pipeline", tmp_path)
    reason = learner_work(solved)
    assert reason and "cells edited since the release: top_k_next_tokens-solution" in reason
    assert "python -m llmcourse progress" in reason
    nb = json.loads((released("00_pipeline") / "00_pipeline.ipynb").read_text())
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code")
    cell["outputs"], cell["execution_count"] = [{"output_type": "stream", "name": "stdout", "text": "hi\n"}], 1
    ran = tmp_path / "ran.ipynb"
    ran.write_text(json.dumps(nb))
    assert "1 cell(s) with saved outputs" in learner_work(ran)
