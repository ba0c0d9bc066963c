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

    >>> import plotly.graph_objects as go
    >>> fig = go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]))
    >>> sorted(bundle(fig, "demo"))
    ['application/vnd.plotly.v1+json', 'text/html']
"""

from __future__ import annotations

import json
import re

PLOTLY_MIME = "application/vnd.plotly.v1+json"
CONFIG = {"displaylogo": False, "responsive": True}


def _check_name(name: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise ValueError(f"figure name {name!r}: use lowercase letters, digits and '-' (it becomes the HTML id)")
    return name


def bundle(fig, name: str) -> dict:
    """The mime bundle `show` displays: Plotly JSON for JupyterLab, HTML for the book.

    `name` (unique on the page) becomes the element id `fig-<name>`, so a notebook run twice writes
    the same output.
    """
    import plotly.io as pio

    div_id = f"fig-{_check_name(name)}"
    spec = json.loads(pio.to_json(fig, validate=True))
    height = fig.layout.height or 450
    html = pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id, config=CONFIG,
                       default_height=f"{height}px", default_width="100%", validate=False)
    return {PLOTLY_MIME: {**spec, "config": CONFIG}, "text/html": html}


def show(fig, name: str) -> None:
    """Display a Plotly figure so that it is interactive in JupyterLab and on the static page."""
    from IPython.display import display

    display(bundle(fig, name), raw=True)
