"""The speculative decoding benchmark (`python -m llmcourse bench --speculative`): its metrics and predictions on
hand-made rounds, its workloads, the same-tokens check, and the command end to end on quick sizes. No timing is
asserted: only that the figures exist, are computed right and are sane."""

import json
import math
import re
import struct
from pathlib import Path

import pytest
import torch

from llmcourse.bench import speculative as sb
from llmcourse.bench.common import CONFIGS
from llmcourse.engine.model import GPT2
from llmcourse.engine.speculative import Round, SpeculationStats, expected_speedup

ROOT = Path(__file__).resolve().parent.parent


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------------------------------------- metrics


def test_alpha_per_proposal_counts_one_rejection_per_round_that_stopped():
    rounds = [
        Round([1, 2, 3], 3, 4),  # all kept: 3 accepted, no rejection
        Round([5, 6, 7], 0, 8),  # first rejected: 0 accepted, 1 rejection (6 and 7 never judged)
        Round([5, 6, 7], 2, 8),  # 2 accepted, 1 rejection
        Round([], 0, 9),
    ]  # prompt lookup found nothing: neither
    assert sb.alpha_per_proposal(rounds) == pytest.approx(5 / 7)
    stats = SpeculationStats(rounds=rounds, new_tokens=10)
    f = sb.round_figures(stats)
    assert f["acceptance_rate"] == pytest.approx(5 / 9)  # accepted / proposed: lower, it counts 6 and 7
    assert (f["rounds"], f["drafted"], f["accepted"], f["rejections"]) == (4, 9, 5, 2)
    assert f["alpha"] == pytest.approx(5 / 7) and f["tokens_per_forward"] == pytest.approx(10 / 4)
    assert f["acceptance_by_position"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert sb.alpha_per_proposal([]) == 0


def test_alpha_per_proposal_recovers_a_known_alpha():
    """Rounds simulated with i.i.d. acceptances of probability 0.6: the estimate finds 0.6; accepted / proposed
    does not (it falls with k)."""
    g = torch.Generator().manual_seed(0)
    for k in (1, 4, 8):
        rounds = []
        for _ in range(4000):
            kept = torch.rand(k, generator=g) < 0.6
            accepted = k if bool(kept.all()) else int((~kept).float().argmax())
            rounds.append(Round(list(range(k)), accepted, 0))
        assert sb.alpha_per_proposal(rounds) == pytest.approx(0.6, abs=0.02), k
        rate = SpeculationStats(rounds=rounds).acceptance_rate
        assert rate == pytest.approx(sum(0.6**i for i in range(1, k + 1)) / k, abs=0.02), k


def test_refined_speedup_is_the_formula_with_the_verify_cost():
    for alpha, k, c in [(0.5, 1, 0.25), (0.57, 4, 0.26), (0.9, 8, 0.0), (1.0, 3, 0.1), (0.0, 2, 0.3)]:
        assert sb.refined_speedup(alpha, k, c, 1.0) == pytest.approx(expected_speedup(alpha, k, c))
    # α = 0.5, k = 2: 1.75 tokens per round; the draft 2 x 0.25, the verify pass 1.5 decode steps
    assert sb.refined_speedup(0.5, 2, 0.25, 1.5) == pytest.approx(1.75 / 2.0)
    assert expected_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert sb.refined_speedup(1.0, 3, 0.0, 2.0) == pytest.approx(4 / 2)


def test_predict_pools_alpha_over_every_k_and_picks_the_best_k():
    def row(accepted, rejections, speedup, rounds, lengths):
        return {
            "accepted": accepted,
            "rejections": rejections,
            "speedup": speedup,
            "seconds": 2 / speedup,
            "rounds": rounds,
            "proposal_lengths": lengths,
        }

    section = {
        "prompts": 2,
        "new_tokens": 10,
        "plain": {"seconds": 2.0},
        "ks": {1: row(3, 1, 0.9, 5, {1: 5}), 2: row(5, 3, 1.1, 4, {2: 4}), 3: row(4, 3, 1.1, 4, {0: 1, 3: 3})},
    }
    costs = {"target_ms": {1: 10.0, 2: 12.0, 3: 15.0, 4: 25.0}, "verify_ratio": {2: 1.2, 3: 1.5, 4: 2.5}}
    sb.predict(section, costs, draft_ms=2.5)
    alpha, c = 12 / 19, 0.25
    assert section["alpha"] == pytest.approx(alpha) and section["c"] == c
    assert section["plain"]["ms_per_token"] == pytest.approx(100) and section["plain"]["forward_ms"] == 10
    for k, v in section["ks"].items():
        assert v["formula"] == pytest.approx(expected_speedup(alpha, k, c))
        assert v["refined"] == pytest.approx(sb.refined_speedup(alpha, k, c, costs["verify_ratio"][k + 1]))
        assert v["expected_tokens_per_forward"] == pytest.approx(sum(alpha**i for i in range(k + 1)))
        assert v["round_ms"] == pytest.approx(1e3 * v["seconds"] / v["rounds"])
    # each round: its proposals' draft forwards, then the target over them and one more token
    assert section["ks"][1]["forwards_ms"] == pytest.approx(2.5 + 12)
    assert section["ks"][3]["forwards_ms"] == pytest.approx((1 * 10 + 3 * (3 * 2.5 + 25)) / 4)
    assert section["best_k_speedup"] == 2  # a tie goes to the smaller k
    assert section["best_k_formula"] == max(section["ks"], key=lambda k: section["ks"][k]["formula"])
    assert section["best_k_refined"] == max(section["ks"], key=lambda k: section["ks"][k]["refined"])


# ---------------------------------------------------------------------------------------------- workloads


def test_passages_are_evenly_spaced_and_whole():
    tokens = list(range(1000))
    got = sb.passages(tokens, 3, 40)
    assert [len(p) for p in got] == [40, 40, 40]
    assert [p[0] for p in got] == [146, 479, 812]  # the middle of each third
    assert all(p == list(range(p[0], p[0] + 40)) for p in got)
    assert sb.passages(tokens, 1, 1000) == [tokens]
    with pytest.raises(ValueError, match="cannot cut 3 passages of 400 tokens from 1000"):
        sb.passages(tokens, 3, 400)


def test_the_self_quote_holds_the_passage_its_continuation_and_the_passage_again():
    assert sb.self_quote([5, 6], [7, 8, 9]) == [5, 6, 7, 8, 9, 5, 6]
    assert sb.self_quote((5,), []) == [5, 5]


# ---------------------------------------------------------------------------------------------- runners


@pytest.fixture(scope="module")
def tiny_pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the benchmark runs: on a busy 2-core machine two threads wait for each other
    target = GPT2(CONFIGS["tiny"]).init_weights(0).eval().requires_grad_(False)
    draft = GPT2(CONFIGS["tiny"]).init_weights(1).eval().requires_grad_(False)
    yield target, draft
    torch.set_num_threads(threads)


def test_sweep_checks_every_run_against_plain_greedy(tiny_pair):
    target, draft = tiny_pair
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    lines = []
    s = sb.sweep(target, draft, prompts, [1, 3], 10, 2, lines.append, "tiny")
    assert s["same_tokens"] is True and s["prompts"] == 2 and s["prompt_tokens"] == 8 and s["new_tokens"] == 10
    assert set(s["ks"]) == {1, 3} and len(lines) == 2
    for k, v in s["ks"].items():
        assert v["new_tokens"] == 20  # both prompts' rounds
        assert v["rounds"] == v["new_tokens"] - v["accepted"]  # each round adds its accepted proposals and one token
        assert 1 <= v["tokens_per_forward"] <= k + 1
        assert v["speedup"] == pytest.approx(s["plain"]["seconds"] / v["seconds"])
        assert v["tokens_per_s"] == pytest.approx(20 / v["seconds"])


def test_sweep_refuses_other_tokens_than_plain_greedy(tiny_pair, monkeypatch):
    target, draft = tiny_pair
    real = sb.generate

    def off_by_one(model, prompt, **kw):
        out = real(model, prompt, **kw)
        return out[:-1] + [(out[-1] + 1) % 50] if kw.get("draft") is not None else out

    monkeypatch.setattr(sb, "generate", off_by_one)
    with pytest.raises(RuntimeError, match=r"\(tiny, k=2\) gave other tokens than plain greedy decoding for prompt 0"):
        sb.sweep(target, draft, [[1, 2, 3]], [2], 6, 1, lambda s: None, "tiny")


def test_forward_costs_and_greedy_agreement(tiny_pair):
    target, draft = tiny_pair
    sizes = sb.Sizes(verify_tokens=3, context=16)
    timer = sb.cost_timer(target, draft, sizes)
    timer.sample(2)
    timer.sample(1)
    costs = sb.costs_of(timer)
    assert costs["samples"] == 3 and costs["context"] == 16
    assert set(costs["target_ms"]) == {1, 2, 3} and costs["verify_ratio"][1] == 1
    assert costs["c"] == pytest.approx(costs["draft_ms"] / costs["target_ms"][1])
    assert all(v > 0 for v in costs["target_ms"].values())
    assert all(run[2].length == 16 for run in timer.runs.values())  # every pass saw `context` cached positions
    no_draft = sb.cost_timer(target, None, sizes)
    no_draft.sample(1)
    assert "c" not in sb.costs_of(no_draft) and "draft" not in no_draft.times
    tokens = torch.arange(3 * 32 + 1) % 64
    assert sb.greedy_agreement(target, target, tokens, context=32) == 1.0
    assert 0 <= sb.greedy_agreement(target, draft, tokens, context=32) < 1


# ---------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def quick_results():
    """The whole benchmark on the bundled pair with quick sizes (a few seconds)."""
    threads = torch.get_num_threads()
    lines = []
    r = sb.run(device="cpu", sizes=sb.QUICK, progress=lines.append)
    assert torch.get_num_threads() == threads  # restored
    return r, lines


def test_the_benchmark_measures_every_figure(quick_results):
    r, lines = quick_results
    assert r["threads"] == 1 and r["machine"]["cpu"] and r["target"] == sb.TARGET and r["draft"] == sb.DRAFT
    assert 0 < r["costs"]["c"] < 1  # the draft is the cheaper model
    assert 0.3 < r["overlap_alpha"] < 0.9 and 0.2 < r["greedy_agreement"] < 0.9 and r["alpha_tokens"] == 512
    for name in ("draft_model", "prompt_lookup"):
        s = r[name]
        assert s["same_tokens"] is True and set(s["ks"]) == set(sb.QUICK.ks)
        assert 0 <= s["alpha"] <= 1 and s["best_k_speedup"] in sb.QUICK.ks
        for k, v in s["ks"].items():
            for key in ("seconds", "tokens_per_s", "speedup", "formula", "refined", "tokens_per_forward"):
                assert isinstance(v[key], float) and math.isfinite(v[key]) and v[key] > 0, (name, k, key)
            assert v["refined"] == pytest.approx(
                sb.refined_speedup(s["alpha"], k, s["c"], r["costs"]["verify_ratio"][k + 1])
            )
    for name in ("draft_model", "prompt_lookup"):  # num_draft_tokens="auto": the k's best_k chose, timed as the rest
        auto = r[name]["auto"]
        assert auto["speedup"] > 0 and auto["new_tokens"] == r[name]["prompts"] * r[name]["new_tokens"]
        assert all(1 <= c["k"] <= 8 and 0 <= c["alpha"] <= 1 for c in auto["chosen"])
    assert {c["c"] for c in r["prompt_lookup"]["auto"]["chosen"]} <= {0.0}
    assert r["prompt_lookup"]["c"] == 0 and r["draft_model"]["c"] == r["costs"]["c"]
    assert "small" not in r and any("prompt lookup" in line for line in lines)
    json.dumps(r)  # all of it goes into bench.json


def test_table_and_figure(quick_results, tmp_path):
    r, _ = quick_results
    text = sb.table(r)
    assert text.count("same tokens as plain greedy: yes") == 2 and text.count("num_draft_tokens='auto'") == 2
    assert f"c = {r['costs']['c']:.2f}" in text and f"{r['overlap_alpha']:.3f}" in text
    for s in (r["draft_model"], r["prompt_lookup"]):
        assert f"best k: measured {s['best_k_speedup']} ({s['ks'][s['best_k_speedup']]['speedup']:.2f}x)" in text
    width, height = png_size(sb.plot(r, tmp_path))
    assert 600 <= width <= 1600 and 0.3 < height / width < 2.5
    back = json.loads(json.dumps(r))  # keys become strings: the table reads them back alike
    assert sb.table(back) == text


def test_bench_speculative_end_to_end_keeps_the_rest_of_bench_json(quick_results, tmp_path, monkeypatch, capsys):
    """`python -m llmcourse bench --speculative`, in this process, on the measurements above (`run` is tested
    there): the flags reach it, the JSON keeps the other sections, the table and the figure come."""
    from llmcourse.__main__ import main

    calls = []
    measured = json.loads(json.dumps(quick_results[0]))
    monkeypatch.setattr(sb, "run", lambda **kw: calls.append(kw) or measured)
    (tmp_path / "bench.json").write_text(json.dumps({"decode": {"engine": 1.0}}))
    args = [
        "bench",
        "--speculative",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--repeats",
        "5",
        "--out",
        str(tmp_path),
    ]
    assert main(args) == 0
    assert len(calls) == 1 and calls[0]["device"] == "cpu" and calls[0]["dtype"] == "bfloat16"
    assert calls[0]["sizes"] == sb.Sizes(repeats=5)
    out, err = capsys.readouterr()
    r = json.loads((tmp_path / "bench.json").read_text())
    assert r["decode"] == {"engine": 1.0} and r["speculative"] == measured  # the other sections stay
    assert re.search(r"best k: measured \d \(\d+\.\d\dx\)", out)
    assert (tmp_path / sb.FIGURE).exists() and str(tmp_path / sb.FIGURE) in out
    assert not err


def test_a_failing_table_or_figure_loses_no_measurement(quick_results, tmp_path, monkeypatch, capsys):
    measured = json.loads(json.dumps(quick_results[0]))
    monkeypatch.setattr(sb, "run", lambda **kw: measured)
    monkeypatch.setattr(sb, "plot", lambda *a: 1 / 0)
    assert sb.main(tmp_path) == 1
    out, err = capsys.readouterr()
    assert "ZeroDivisionError" in err and "the measurements are in" in err and "best k: measured" in out
    assert json.loads((tmp_path / "bench.json").read_text())["speculative"] == measured


def test_an_error_is_one_line(tmp_path, monkeypatch, capsys):
    def bad(**kw):
        raise ValueError("no such device")

    monkeypatch.setattr(sb, "run", bad)
    assert sb.main(tmp_path) == 2
    assert capsys.readouterr().err == "python -m llmcourse bench: error: no such device\n"
    assert not (tmp_path / "bench.json").exists()


def test_the_speculative_flag(capsys):
    from llmcourse.__main__ import build_parser, main

    assert build_parser().parse_args(["bench", "--speculative"]).speculative is True
    assert build_parser().parse_args(["bench"]).speculative is False
    with pytest.raises(SystemExit) as exit:
        main(["bench", "--speculative", "--serving", "tiny"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and "not allowed with argument" in err, err


def test_the_benchmarks_page_shows_the_speculative_figures():
    """benchmarks.md's speculative section shows bench_speculative.png and quotes the committed measurements."""
    page = (ROOT / "benchmarks.md").read_text()
    section = page[page.index("## Speculative decoding") :]
    assert f"](images/{sb.FIGURE})" in section and png_size(ROOT / "images" / sb.FIGURE)[0] >= 600
    r = json.loads((ROOT / "images" / "bench.json").read_text())["speculative"]
    assert r["draft_model"]["same_tokens"] and r["prompt_lookup"]["same_tokens"]
    assert "python -m llmcourse bench --speculative" in section
    assert f"{r['costs']['c']:.2f}" in section
    for name in ("draft_model", "prompt_lookup"):
        s = r[name]
        best = s["ks"][str(s["best_k_speedup"])]
        assert f"{best['speedup']:.2f}×" in section, name
        assert f"{s['alpha']:.2f}" in section, name
