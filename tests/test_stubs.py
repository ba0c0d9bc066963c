"""A demo cell that calls an exercise still a stub says so in one line (issue 22: a bare 20-line
NotImplementedError traceback). `import llmcourse` inside IPython installs it (llmcourse.course.stubs)."""

import nbformat
import pytest
from nbclient import NotebookClient

STUB = "def embedding(weight, ids):\n    # YOUR CODE HERE\n    raise NotImplementedError()"
ONE_LINE = (
    "NotImplementedError: `embedding` is not written yet: write it in its exercise cell above first (its check "
    "must pass), then run this cell again"
)


def run(*sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s, id=f"c{i}") for i, s in enumerate(sources)]
    NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3").execute()
    return [cell.outputs for cell in nb.cells]


def errors(outputs):
    return [o for o in outputs if o.output_type == "error"]


def test_a_stub_called_from_a_demo_cell_is_one_line_in_a_kernel():
    setup, stub, demo, other, elsewhere = run(
        "import llmcourse, torch",
        STUB,
        "x = embedding(torch.zeros(3, 2), torch.tensor([0]))",
        "1 / 0",
        "raise NotImplementedError('not a stub')",
    )
    (error,) = errors(demo)
    assert error.ename == "NotImplementedError" and error.traceback == [ONE_LINE]
    # everything else keeps IPython's traceback, and a failing cell still fails
    assert errors(other)[0].ename == "ZeroDivisionError" and len(errors(other)[0].traceback) > 1
    assert len(errors(elsewhere)[0].traceback) > 1


def test_only_a_bare_stub_of_the_notebook_is_named():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from llmcourse.course import stubs

    shell = InteractiveShell.instance()
    stubs.install(shell)
    with capture_output() as shown:
        shell.run_cell(
            STUB + "\nclass KVCache:\n    def update(self, layer, k, v):\n        raise NotImplementedError()"
        )
        shell.run_cell("KVCache().update(0, None, None)")
        shell.run_cell("embedding(1, 2)")
        shell.run_cell("raise NotImplementedError")  # a raise outside any function
    lines = shown.stdout.splitlines()
    assert lines[0] == ONE_LINE.replace("`embedding`", "`KVCache.update`") and lines[1] == ONE_LINE
    assert len(lines) > 3, "a raise outside any function keeps its traceback"


def test_written_names_the_first_stub_in_one_line():
    """A figure drawn from a demo's results calls `written` first (chapter 09): on the release it names the stub."""
    from llmcourse.course.stubs import NotWritten, message, written

    def smooth_scales(act_absmax, weight, alpha=0.5):
        # YOUR CODE HERE
        raise NotImplementedError()

    def quantize_int8(w):
        return w

    written(quantize_int8, len)  # nothing is a stub: nothing said
    with pytest.raises(NotWritten) as said:
        written(quantize_int8, smooth_scales)
    assert isinstance(said.value, NotImplementedError)
    assert said.value._render_traceback_() == [message("smooth_scales")]
