"""Shared fixtures: random GPT-2 models in our engine and their twins in transformers."""

from __future__ import annotations

import warnings

import pytest
import torch

from llmcourse import GPT2, GPT2Config, get_tokenizer, save_model
from llmcourse.checks.kv_cache import one_thread as single_thread

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="no CUDA device"))]

SMALL = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=256)


def lively_model(config: GPT2Config, seed: int = 0) -> GPT2:
    """Random weights that give varied continuations.

    With GPT-2's own initialization a random model repeats its last token forever (the tied head
    favours the input embedding); larger position embeddings and weights make every step differ,
    so greedy and beam search comparisons exercise many different tokens and scores.
    """
    model = GPT2(config).init_weights(seed).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.wpe.weight.copy_(torch.randn(model.wpe.weight.shape, generator=g))
        model.wte.weight.mul_(10)
        for block in model.h:
            block.mlp.c_fc.weight.mul_(10)
            block.attn.c_attn.weight.mul_(10)
    return model.requires_grad_(False)


def hf_twin(model: GPT2, folder):
    """The same weights in transformers' GPT2LMHeadModel, loaded from a saved folder."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    save_model(model, folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPT2LMHeadModel.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): a
    second thread only spins against the other processes on the cores, up to 12x slower here."""
    with single_thread():
        yield


@pytest.fixture(scope="session")
def tokenizer():
    return get_tokenizer()


@pytest.fixture(scope="session")
def small_pair(tmp_path_factory):
    """(our model, transformers' model) with the same lively random weights, small config."""
    model = lively_model(SMALL, seed=0)
    return model, hf_twin(model, tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="session")
def small_folder(small_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("small_saved")
    save_model(small_pair[0], folder)
    return folder


@pytest.fixture(scope="session")
def course_run(tmp_path_factory):
    """The whole course released, graded for ada (every solution) and bob (the release untouched), with feedback,
    grades and ada's progress: each notebook executed once (tests/course_run.py). Several minutes."""
    from .course_run import run_course

    return run_course(tmp_path_factory.mktemp("course_run"))


@pytest.fixture
def server_log():
    """What the server logs during the test; it fails if that holds a traceback or an error (tests/server_log.py)."""
    from .server_log import collect_server_log

    yield from collect_server_log()
