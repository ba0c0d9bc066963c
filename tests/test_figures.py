"""`llmcourse.course.figures`: a figure's stored output does not depend on float noise (issue 22: refreshing an
unchanged chapter 02 reported "outputs changed", the Plotly data differing in their last digits)."""

import json

import numpy as np
import plotly.graph_objects as go
import pytest

from llmcourse.course.figures import DIGITS, PLOTLY_MIME, bundle, round_significant


def noisy(x: np.ndarray) -> np.ndarray:
    """`x` one unit in the last place up: what another summation order gives."""
    return np.nextafter(x, np.array(np.inf, dtype=x.dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("as_list", [False, True], ids=["array", "list"])
def test_a_figure_of_data_with_float_noise_is_byte_identical(dtype, as_list):
    z = np.random.default_rng(0).standard_normal((6, 7)).astype(dtype) * 10.0 ** np.arange(-3, 4)
    data = (lambda a: a.tolist()) if as_list else (lambda a: a)
    figure = lambda zz: go.Figure(go.Heatmap(z=data(zz), x=data(zz[0]), hovertemplate="%{z:.3f}"))  # noqa: E731
    assert not np.array_equal(z, noisy(z))
    one, two = bundle(figure(z), "noise"), bundle(figure(noisy(z)), "noise")
    assert json.dumps(one, sort_keys=True) == json.dumps(two, sort_keys=True)


def test_rounding_keeps_what_a_figure_can_show():
    x = np.random.default_rng(1).standard_normal(1000) * 10.0 ** np.random.default_rng(2).integers(-20, 20, 1000)
    x = np.concatenate([x, [0.0, np.inf, -np.inf, np.nan, 1e-300]])
    r = round_significant(x)
    finite = np.isfinite(x)
    assert np.all(np.abs(r[finite] - x[finite]) <= 0.5 * 10.0 ** (1 - DIGITS) * np.abs(x[finite]))
    assert np.array_equal(r[~finite], x[~finite], equal_nan=True)
    assert round_significant(np.array([0.1 + 0.2]))[0] == 0.3


def test_typed_arrays_stay_typed_and_integers_untouched():
    fig = go.Figure(
        go.Scatter(x=np.arange(5, dtype=np.int64) * 123456789, y=np.linspace(0, 1, 5, dtype=np.float32) / 3)
    )
    spec = bundle(fig, "typed")[PLOTLY_MIME]["data"][0]
    assert spec["y"]["dtype"] == "f4"
    x = spec["x"]
    values = x if isinstance(x, list) else np.frombuffer(__import__("base64").b64decode(x["bdata"]), dtype=x["dtype"])
    assert list(values) == [i * 123456789 for i in range(5)]
