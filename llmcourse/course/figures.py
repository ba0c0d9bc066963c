"""Interactive figures that work in JupyterLab and on the book's static pages, with no kernel.

The course's one approach to interactivity: a Plotly figure whose interactive parts — hover,
zoom, dropdown menus and sliders over precomputed data — run in the browser. `show(fig, name)`
displays it in two representations:

- `application/vnd.plotly.v1+json`, which JupyterLab draws with the plotly extension that
  `pip install plotly` installs (no kernel round trip: the figure keeps working after a restart);
- `text/html`, a `<div>` and a script calling `Plotly.newPlot`, which the book renders; the book's
  extension (`_ext/llmcourse_book.py`) serves the plotly.js that ships in the plotly package on the
  pages that need it, so the published pages work offline.

A slider or menu selects among data computed once in the notebook (every layer, every head, every
temperature); nothing needs Python after the cell has run.

Every number in the figure is rounded to `DIGITS` significant digits (more than a figure can show, or a hover
label needs), so a rerun whose floats differ in their last digits (threads summing in another order) stores
the same output: `python -m llmcourse.course.refresh` gives no diff for an unchanged notebook.

    >>> import plotly.graph_objects as go
    >>> fig = go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]))
    >>> sorted(bundle(fig, "demo"))
    ['application/vnd.plotly.v1+json', 'text/html']
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np

PLOTLY_MIME = "application/vnd.plotly.v1+json"
CONFIG = {"displaylogo": False, "responsive": True}
DIGITS = 6  # significant digits kept in a figure's data


def round_significant(values: np.ndarray, digits: int = DIGITS) -> np.ndarray:
    """`values` rounded to `digits` significant digits (same dtype; 0, inf and NaN kept).

    >>> round_significant(np.array([1234.56789, 1.0000001e-9, -0.333333333, 0.0]))
    array([ 1.23457e+03,  1.00000e-09, -3.33333e-01,  0.00000e+00])
    """
    x = np.asarray(values, dtype=np.float64)
    keep = np.isfinite(x) & (x != 0)
    magnitude = np.floor(np.log10(np.abs(np.where(keep, x, 1.0))))
    scale = 10.0 ** (digits - 1 - magnitude)
    return np.where(keep, np.round(x * scale) / scale, x).astype(np.asarray(values).dtype)


def _rounded(node):
    """A figure's JSON with every float rounded (`round_significant`), typed arrays (plotly's `bdata`) included."""
    if isinstance(node, float):
        return float(round_significant(np.array([node]))[0])
    if isinstance(node, list):
        return [_rounded(v) for v in node]
    if isinstance(node, dict):
        if isinstance(node.get("bdata"), str) and str(node.get("dtype", "")).startswith("f"):
            data = np.frombuffer(base64.b64decode(node["bdata"]), dtype=np.dtype(node["dtype"]))
            return {**node, "bdata": base64.b64encode(round_significant(data).tobytes()).decode("ascii")}
        return {k: _rounded(v) for k, v in node.items()}
    return node


def _check_name(name: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise ValueError(f"figure name {name!r}: use lowercase letters, digits and '-' (it becomes the HTML id)")
    return name


def bundle(fig, name: str) -> dict:
    """The mime bundle `show` displays: Plotly JSON for JupyterLab, HTML for the book.

    `name` (unique on the page) becomes the element id `fig-<name>`, so a notebook run twice writes
    the same output.
    """
    import plotly.io as pio  # the course extra, not the engine's: imported when a figure is shown

    div_id = f"fig-{_check_name(name)}"
    spec = _rounded(json.loads(pio.to_json(fig, validate=True)))
    height = fig.layout.height or 450
    html = pio.to_html(
        spec,
        include_plotlyjs=False,
        full_html=False,
        div_id=div_id,
        config=CONFIG,
        default_height=f"{height}px",
        default_width="100%",
        validate=False,
        auto_play=False,  # a figure with frames (a replay) opens where JupyterLab shows it, not playing by itself
    )
    return {PLOTLY_MIME: {**spec, "config": CONFIG}, "text/html": html}


def show(fig, name: str) -> None:
    """Display a Plotly figure so that it is interactive in JupyterLab and on the static page."""
    from IPython.display import display  # the course extra: only inside a notebook

    display(bundle(fig, name), raw=True)
