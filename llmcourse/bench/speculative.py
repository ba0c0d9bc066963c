"""The speculative decoding benchmark (`python -m llmcourse bench --speculative`): plain greedy decoding against
speculative decoding for k = 1 ... 8 proposals per round, in one run, one torch thread, interleaved repeats, medians.

Two drafts, each on its own workload of held-out Shakespeare (`llmcourse.training.shakespeare`):

- **draft model**: `gpt2-shakespeare-draft` (2 layers, 64 wide) proposes for `gpt2-shakespeare` (6 layers,
  192 wide), on a few passages of the held-out plays as prompts;
- **prompt lookup**: the text itself proposes (`prompt_lookup_draft`), on prompts built so that the
  continuation repeats text they hold (`self_quote`: a passage, the target's greedy continuation, the passage
  again); and on GPT-2 124M's configuration with random weights, whose greedy output loops.

Per k, and for num_draft_tokens="auto" (k chosen by `best_k` as it goes; the k's it chose are reported): the
acceptance (proposals accepted / proposed, and α per proposal: accepted / (accepted + rejections),
the α of the formula), tokens per target forward pass, and the wall-time speed-up over plain decoding. Every
speculative run must give plain greedy decoding's tokens (checked, not assumed). The speed-up is predicted
twice:

- the formula, (1 − α^(k+1)) / ((1 − α)(k·c + 1)), c = a draft forward / a target forward (one token each),
  assumes the target scores k + 1 tokens in the time of one;
- the refined prediction replaces that 1 by the measured cost of a target forward over k + 1 tokens,
  verify(k + 1) / verify(1): on a CPU a forward pass is compute-bound after a few tokens.

The forward passes behind c and verify(n) are timed between the decoding passes, so that both see the same
machine (on a shared one, its load changes during a run).

    >>> alpha_per_proposal([Round([1, 2, 3], 3, 4), Round([5, 6, 7], 1, 9)])   # 4 accepted, 1 rejected
    0.8
    >>> round(refined_speedup(alpha=0.5, k=2, c=0.25, verify_ratio=1.0), 4) == round(expected_speedup(0.5, 2, 0.25), 4)
    True
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from llmcourse.engine.generate import NUM_DRAFT_TOKENS, generate
from llmcourse.engine.loading import resolve_device, resolve_dtype
from llmcourse.engine.speculative import (
    AUTO,
    PROMPT_LOOKUP,
    Round,
    SpeculationStats,
    expected_speedup,
    expected_tokens_per_round,
)
from llmcourse.training.shakespeare import acceptance_rate, validation_tokens

from .common import ENGINE, ROOF, STYLE, TRANSFORMERS, describe_machine, load, machine, measure_and_save, save, sync

FIGURE = "bench_speculative.png"
TARGET, DRAFT = "gpt2-shakespeare", "gpt2-shakespeare-draft"
SMALL = "gpt2"  # GPT-2 124M's configuration, random weights: prompt lookup only


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The benchmark's sizes (`QUICK`: the tests')."""

    ks: tuple[int, ...] = tuple(range(1, 9))
    prompts: int = 3  # passages of the held-out plays, one prompt each
    prompt_len: int = 64
    new_tokens: int = 64
    lookup_prompts: int = 3  # prompt lookup: a passage, the target's greedy continuation, the passage again
    passage_len: int = 48
    continuation_len: int = 64
    lookup_new_tokens: int = 64
    repeats: int = 3
    alpha_tokens: int = 2048  # held-out tokens for the distributions' overlap α (the card's used all 107k)
    verify_tokens: int = 9  # target forward passes over 1 ... this many tokens are timed
    context: int = 128  # at this many cached positions (about the middle of a run)
    timing_samples: int = 2  # forward passes of each size timed before each prompt of each pass
    small: bool = True  # also prompt lookup on the 124M configuration
    small_ks: tuple[int, ...] = (1, 2, 4, 8)
    small_new_tokens: int = 24


QUICK = Sizes(
    ks=(1, 2),
    prompts=1,
    prompt_len=16,
    new_tokens=12,
    lookup_prompts=1,
    passage_len=16,
    continuation_len=8,
    lookup_new_tokens=16,
    repeats=1,
    alpha_tokens=512,
    verify_tokens=3,
    context=32,
    small=False,
)


# ----------------------------------------------------------------------------------------------- workloads


def passages(tokens: Sequence[int], n: int, length: int) -> list[list[int]]:
    """n passages of `length` tokens, evenly spaced over `tokens` (the held-out plays: one per play for n = 3)."""
    if n < 1 or length < 1 or n * length > len(tokens):
        raise ValueError(f"cannot cut {n} passages of {length} tokens from {len(tokens)} tokens")
    step = len(tokens) // n
    return [list(tokens[i * step + step // 2 - length // 2 :][:length]) for i in range(n)]


def self_quote(passage: Sequence[int], continuation: Sequence[int]) -> list[int]:
    """A prompt whose continuation repeats text it holds: the passage, the model's own greedy continuation of it,
    the passage again. (Quoting a passage and starting it again does not work on the bundled model: it does not
    copy from its context, it continues as after the passage's last words.)

        >>> self_quote([5, 6], [7, 8, 9])
        [5, 6, 7, 8, 9, 5, 6]
    """
    return [*passage, *continuation, *passage]


# ------------------------------------------------------------------------------------------------- metrics


def alpha_per_proposal(rounds: Sequence[Round]) -> float:
    """α as the formula means it: the chance that a proposal is accepted given that the ones before it were.
    A round either keeps all it proposed or stops at one rejection, so α = accepted / (accepted + rejections).
    (accepted / proposed is lower: the proposals after a rejection count as proposed, never as accepted.)"""
    accepted = sum(r.accepted for r in rounds)
    rejections = sum(r.accepted < len(r.drafted) for r in rounds)
    return accepted / max(accepted + rejections, 1)


def refined_speedup(alpha: float, k: int, c: float, verify_ratio: float) -> float:
    """The formula with the verify pass's measured cost: tokens per round / (k·c + verify(k+1) / verify(1)).
    verify_ratio = 1 is the formula's assumption (scoring k + 1 tokens costs one decode step)."""
    return expected_tokens_per_round(alpha, k) / (k * c + verify_ratio)


def round_figures(stats: SpeculationStats) -> dict:
    """A run's rounds in numbers: rounds (= target forward passes), proposals, accepted, rejections, the
    acceptance rate (accepted / proposed), α per proposal, tokens per target forward, acceptance by position, and
    how many rounds proposed each number of tokens (prompt lookup may find fewer than k, or none)."""
    lengths = [len(r.drafted) for r in stats.rounds]
    return {
        "proposal_lengths": {d: lengths.count(d) for d in sorted(set(lengths))},
        "rounds": len(stats.rounds),
        "new_tokens": stats.new_tokens,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "rejections": sum(r.accepted < len(r.drafted) for r in stats.rounds),
        "acceptance_rate": stats.acceptance_rate,
        "alpha": alpha_per_proposal(stats.rounds),
        "tokens_per_forward": stats.tokens_per_forward,
        "acceptance_by_position": stats.acceptance_by_position(),
    }


def best_k(speedups: dict) -> int:
    """The k of the highest speed-up (the smaller k on a tie)."""
    return max(sorted(speedups), key=lambda k: speedups[k])


# ------------------------------------------------------------------------------------------------- timing


class ForwardTimer:
    """Forward passes with a KV cache of `context` positions, timed in interleaved rounds (`sample`) that a run can
    spread over its length, so that they see the same machine as the decoding they explain. `models` maps a label
    to (model, tokens fed, last_only); the cache is rolled back after each pass, so every one sees `context`."""

    @torch.inference_mode()
    def __init__(self, models: dict[str, tuple], context: int):
        self.context, self.runs, self.times = context, {}, {label: [] for label in models}
        g = torch.Generator().manual_seed(0)
        for label, (model, n, last_only) in models.items():
            cache = model.new_cache(1, context + n)
            model(torch.randint(0, model.config.vocab_size, (1, context), generator=g).to(model.device), cache=cache)
            ids = torch.randint(0, model.config.vocab_size, (1, n), generator=g).to(model.device)
            self.runs[label] = (model, ids, cache, last_only)
            self.once(label)  # warm-up

    @torch.inference_mode()
    def once(self, label: str) -> float:
        model, ids, cache, last_only = self.runs[label]
        sync(model.device)
        start = time.perf_counter()
        model(ids, cache=cache, last_only=last_only)
        sync(model.device)
        cache.length = self.context
        return 1e3 * (time.perf_counter() - start)

    def sample(self, repeats: int) -> None:
        for _ in range(repeats):
            for label in self.runs:
                self.times[label].append(self.once(label))

    def medians(self) -> dict[str, float]:
        """Median ms per label."""
        return {label: statistics.median(ts) for label, ts in self.times.items()}


def cost_timer(target, draft, sizes: Sizes) -> ForwardTimer:
    """Target forwards over 1 ... sizes.verify_tokens tokens (all their logits, as a verify pass needs) and a draft
    forward over 1 token (its last position only, as a proposal needs)."""
    models = {str(n): (target, n, False) for n in range(1, sizes.verify_tokens + 1)}
    if draft is not None:
        models["draft"] = (draft, 1, True)
    return ForwardTimer(models, sizes.context)


def costs_of(timer: ForwardTimer) -> dict:
    """A `cost_timer`'s medians: target_ms per tokens fed, verify(n) / verify(1), and with a draft draft_ms and c."""
    ms = timer.medians()
    target_ms = {int(n): v for n, v in ms.items() if n != "draft"}
    out = {
        "context": timer.context,
        "samples": len(timer.times["1"]),
        "target_ms": target_ms,
        "verify_ratio": {n: v / target_ms[1] for n, v in target_ms.items()},
    }
    if "draft" in ms:
        out |= {"draft_ms": ms["draft"], "c": ms["draft"] / target_ms[1]}
    return out


class Sweep:
    """Plain greedy decoding and speculative decoding with `draft` for each k, each prompt alone, pass by pass
    (`run_pass`); `result()`: median seconds, speed-ups and each k's rounds. Within a pass, every configuration
    decodes the first prompt, then the second, ... (the order of the configurations reversed every other pass):
    a change of the machine's load hits all of them alike. Every run's tokens are checked against plain
    decoding's."""

    def __init__(self, target, draft, prompts: list[list[int]], ks: Sequence[int], new_tokens: int, label: str):
        self.target, self.draft, self.prompts, self.ks, self.new_tokens, self.label = (
            target,
            draft,
            prompts,
            list(ks),
            new_tokens,
            label,
        )
        self.configs = ["plain", *ks, AUTO]
        self.times: dict = {name: [] for name in self.configs}
        self.stats = {k: SpeculationStats() for k in [*ks, AUTO]}  # of the first pass
        start = time.perf_counter()
        self.expected = [self.decode(p, "plain", None) for p in prompts]  # also warms up
        self.wall = time.perf_counter() - start

    def decode(self, prompt: list[int], name, stats: Optional[SpeculationStats]) -> list[int]:
        if name == "plain":
            return generate(self.target, prompt, max_new_tokens=self.new_tokens, eos_token_id=None)
        return generate(
            self.target,
            prompt,
            max_new_tokens=self.new_tokens,
            eos_token_id=None,
            draft=self.draft,
            num_draft_tokens=name,
            stats=stats,
        )

    def run_pass(self, rep: int, between: Callable[[], None] = lambda: None) -> None:
        """One pass; `between()` runs before each prompt (the forward passes' timing)."""
        started = time.perf_counter()
        seconds = dict.fromkeys(self.configs, 0.0)
        for i, prompt in enumerate(self.prompts):
            between()
            for name in self.configs if rep % 2 == 0 else self.configs[::-1]:
                stats = self.stats[name] if rep == 0 and name != "plain" else SpeculationStats()
                sync(self.target.device)
                start = time.perf_counter()
                got = self.decode(prompt, name, stats)
                sync(self.target.device)
                seconds[name] += time.perf_counter() - start
                if got != self.expected[i]:
                    raise RuntimeError(
                        f"speculative decoding ({self.label}, k={name}) gave other tokens than plain "
                        f"greedy decoding for prompt {i}: {got[:16]}... instead of "
                        f"{self.expected[i][:16]}..."
                    )
        for name, t in seconds.items():
            self.times[name].append(t)
        self.wall += time.perf_counter() - started

    def result(self) -> dict:
        seconds = {name: statistics.median(ts) for name, ts in self.times.items()}
        tokens = len(self.prompts) * self.new_tokens
        return {
            "prompts": len(self.prompts),
            "prompt_tokens": sum(map(len, self.prompts)),
            "new_tokens": self.new_tokens,
            "repeats": len(self.times["plain"]),
            "wall_s": self.wall,
            "same_tokens": True,
            "plain": {"seconds": seconds["plain"], "tokens_per_s": tokens / seconds["plain"]},
            "ks": {
                k: {
                    "seconds": seconds[k],
                    "tokens_per_s": tokens / seconds[k],
                    "speedup": seconds["plain"] / seconds[k],
                    **round_figures(self.stats[k]),
                }
                for k in self.ks
            },
            AUTO: {
                "seconds": seconds[AUTO],
                "tokens_per_s": tokens / seconds[AUTO],
                "speedup": seconds["plain"] / seconds[AUTO],
                "chosen": [dataclasses.asdict(c) for c in self.stats[AUTO].choices],  # each prompt's choices
                **round_figures(self.stats[AUTO]),
            },
        }


def sweep(
    target,
    draft,
    prompts: list[list[int]],
    ks: Sequence[int],
    new_tokens: int,
    repeats: int,
    progress: Callable[[str], None],
    label: str,
) -> dict:
    """A `Sweep` run for `repeats` passes in a row; -> its result."""
    s = Sweep(target, draft, prompts, ks, new_tokens, label)
    for rep in range(repeats):
        progress(f"speculative, {label}: pass {rep + 1} of {repeats} (plain, k = {', '.join(map(str, ks))})")
        s.run_pass(rep)
    return s.result()


def predict(section: dict, costs: dict, draft_ms: float) -> None:
    """Add to a `sweep` section: α (pooled over every k's rounds), c (`draft_ms` / a target forward), per k the
    formula's and the refined prediction, the measured ms per round (prefills included) against the forward
    passes it made (each round: its proposals' draft forwards and a target forward over them + 1 token), and the
    best k of each. `costs` from `costs_of`."""
    target_ms = costs["target_ms"]
    accepted = sum(v["accepted"] for v in section["ks"].values())
    rejections = sum(v["rejections"] for v in section["ks"].values())
    alpha = accepted / max(accepted + rejections, 1)
    c = draft_ms / target_ms[1]
    section["alpha"], section["c"] = alpha, c
    tokens = section["prompts"] * section["new_tokens"]
    section["plain"] |= {"ms_per_token": 1e3 * section["plain"]["seconds"] / tokens, "forward_ms": target_ms[1]}
    for k, v in section["ks"].items():
        v["formula"] = expected_speedup(alpha, k, c)
        v["refined"] = refined_speedup(alpha, k, c, costs["verify_ratio"][k + 1])
        v["expected_tokens_per_forward"] = expected_tokens_per_round(alpha, k)
        v["round_ms"] = 1e3 * v["seconds"] / v["rounds"]
        v["forwards_ms"] = (
            sum(n * (d * draft_ms + target_ms[d + 1]) for d, n in v["proposal_lengths"].items()) / v["rounds"]
        )
    for key in ("speedup", "formula", "refined"):
        section[f"best_k_{key}"] = best_k({k: v[key] for k, v in section["ks"].items()})


def run(
    *,
    device: str = "auto",
    dtype: str = "float32",
    threads: int = 1,
    sizes: Sizes = Sizes(),
    progress: Callable[[str], None] = print,
) -> dict:
    """The whole benchmark; -> the figures (bench.json's "speculative" section). `threads` torch threads (one, as
    the serving benchmark's figures: on a shared 2-core machine two threads wait for each other)."""
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        target, draft = load(TARGET, dev, dt), load(DRAFT, dev, dt)
        held_out = validation_tokens()
        weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
        r: dict = {
            "device": str(dev),
            "dtype": str(dt).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "machine": machine(dev, weight_bytes),
            "sizes": dataclasses.asdict(sizes),
            "target": TARGET,
            "draft": DRAFT,
            "num_draft_tokens_default": NUM_DRAFT_TOKENS,
        }
        started = time.perf_counter()

        progress(f"speculative: α as the distributions' overlap on {sizes.alpha_tokens} held-out tokens")
        alpha_ids = held_out[: sizes.alpha_tokens + 1]
        r["overlap_alpha"] = acceptance_rate(target, draft, alpha_ids, batch_size=4)  # 4 x 256 x 50257 logits
        r["greedy_agreement"] = greedy_agreement(target, draft, alpha_ids)
        r["alpha_tokens"] = len(alpha_ids) - 1

        progress("speculative: preparing the prompts, warming up")
        timer = cost_timer(target, draft, sizes)
        prompts = passages(held_out.tolist(), sizes.prompts, sizes.prompt_len)
        quotes = [
            self_quote(p, generate(target, p, max_new_tokens=sizes.continuation_len, eos_token_id=None))
            for p in passages(held_out.tolist(), sizes.lookup_prompts, sizes.passage_len)
        ]
        sweeps = {
            "draft_model": Sweep(target, draft, prompts, sizes.ks, sizes.new_tokens, "draft model"),
            "prompt_lookup": Sweep(target, PROMPT_LOOKUP, quotes, sizes.ks, sizes.lookup_new_tokens, "prompt lookup"),
        }
        for rep in range(sizes.repeats):  # the forward passes are timed in every pass, between the sweeps
            for s in sweeps.values():
                progress(
                    f"speculative, {s.label}: pass {rep + 1} of {sizes.repeats} (plain, k = "
                    f"{', '.join(map(str, sizes.ks))})"
                )
                s.run_pass(rep, between=lambda: timer.sample(sizes.timing_samples))
        r["costs"] = costs = costs_of(timer)
        for name, s in sweeps.items():
            r[name] = s.result()
            predict(r[name], costs, costs["draft_ms"] if s.draft is draft else 0.0)

        if sizes.small:
            small = load(SMALL, dev, dt)
            repeats = max(sizes.repeats - 1, 1)
            progress(f"speculative, {SMALL} (random weights): warming up")
            timer = cost_timer(small, None, dataclasses.replace(sizes, verify_tokens=max(sizes.small_ks) + 1))
            s = Sweep(
                small, PROMPT_LOOKUP, quotes[:1], sizes.small_ks, sizes.small_new_tokens, f"{SMALL}, prompt lookup"
            )
            for rep in range(repeats):
                progress(
                    f"speculative, {s.label}: pass {rep + 1} of {repeats} (plain, k = "
                    f"{', '.join(map(str, sizes.small_ks))})"
                )
                s.run_pass(rep, between=lambda: timer.sample(sizes.timing_samples))
            small_costs = costs_of(timer)
            section = s.result()
            predict(section, small_costs, 0.0)
            cfg = small.config
            r["small"] = {
                "model": SMALL,
                "config": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd},
                "costs": small_costs,
                "prompt_lookup": section,
            }
        r["seconds"] = time.perf_counter() - started
        return r
    finally:
        torch.set_num_threads(before)


@torch.inference_mode()
def greedy_agreement(target, draft, tokens: torch.Tensor, context: int = 256, batch_size: int = 4) -> float:
    """How often the draft's argmax is the target's, over the same windows as `acceptance_rate`: greedy
    speculative decoding's acceptance on held-out text (a proposal is kept iff it is the target's argmax)."""
    context = min(context, target.config.n_positions, draft.config.n_positions)
    n = (len(tokens) - 1) // context
    windows = tokens[: n * context].view(n, context).to(target.device)  # [n, context]
    same = sum(int((target(rows).argmax(-1) == draft(rows).argmax(-1)).sum()) for rows in windows.split(batch_size))
    return same / (n * context)


# ------------------------------------------------------------------------------------------------ reporting


def by_k(section: dict) -> list[tuple[int, dict]]:
    """A sweep's rows in order of k (ints from `run`, strings once read back from JSON)."""
    return sorted((int(k), v) for k, v in section["ks"].items())


def table(r: dict) -> str:
    costs = r["costs"]
    vr = {int(n): v for n, v in costs["verify_ratio"].items()}
    tm = {int(n): v for n, v in costs["target_ms"].items()}
    lines = [
        f"speculative decoding: {r['target']} with {r['draft']}, {r['device']}, {r['dtype']}, "
        f"{r['threads']} thread(s), median of {r['sizes']['repeats']}",
        "machine: " + describe_machine(r["machine"]),
        f"  forward pass with {costs['context']} cached positions: target {tm[1]:.2f} ms for 1 token, draft "
        f"{costs['draft_ms']:.2f} ms: c = {costs['c']:.2f}",
        "  target forward over n tokens (verify(n) / verify(1)): "
        + ", ".join(f"{n}: {tm[n]:.1f} ms ({vr[n]:.2f}x)" for n in sorted(tm)),
        f"  α as the distributions' overlap on {r['alpha_tokens']} held-out tokens: {r['overlap_alpha']:.3f} "
        f"(sampling); the argmaxes agree on {r['greedy_agreement']:.1%} of them (greedy)",
    ]
    sections = [("draft model", r["draft_model"]), ("prompt lookup", r["prompt_lookup"])]
    if "small" in r:
        sections.append((f"{r['small']['model']} (random weights), prompt lookup", r["small"]["prompt_lookup"]))
    for name, s in sections:
        plain = s["plain"]
        lines.append(
            f"  {name}: {s['prompts']} prompt(s) of {s['prompt_tokens'] // s['prompts']} tokens, "
            f"{s['new_tokens']} new tokens each ({s['wall_s']:.0f} s); same tokens as plain greedy: "
            f"{'yes' if s['same_tokens'] else 'NO'}"
        )
        lines.append(
            f"    plain {plain['tokens_per_s']:.1f} tok/s ({plain['ms_per_token']:.1f} ms per token, a forward "
            f"{plain['forward_ms']:.1f} ms); α per proposal {s['alpha']:.3f}, c = {s['c']:.2f}"
        )
        lines.append(
            f"    {'k':>3}{'accepted':>9}{'α':>6}{'tok/fwd':>9}{'α-model':>8}{'ms/round':>9}{'fwds':>6}"
            f"{'tok/s':>7}{'speed-up':>9}{'formula':>8}{'refined':>8}"
        )
        for k, v in by_k(s):
            lines.append(
                f"    {k:>3}{v['acceptance_rate']:>9.0%}{v['alpha']:>6.2f}{v['tokens_per_forward']:>9.2f}"
                f"{v['expected_tokens_per_forward']:>8.2f}{v['round_ms']:>9.1f}{v['forwards_ms']:>6.1f}"
                f"{v['tokens_per_s']:>7.1f}{v['speedup']:>8.2f}x{v['formula']:>7.2f}x{v['refined']:>7.2f}x"
            )
        lines.append(
            f"    best k: measured {s['best_k_speedup']} ({dict(by_k(s))[s['best_k_speedup']]['speedup']:.2f}x), "
            f"formula {s['best_k_formula']}, refined {s['best_k_refined']}"
        )
        if AUTO in s:  # figures saved before num_draft_tokens="auto" have none
            auto = s[AUTO]
            chosen = ", ".join(map(str, sorted({c["k"] for c in auto["chosen"]}))) or "-"
            lines.append(
                f"    num_draft_tokens='auto' (best_k every few rounds): chose k = {chosen}, "
                f"{auto['tokens_per_forward']:.2f} tokens per forward, {auto['speedup']:.2f}x"
            )
    return "\n".join(lines)


def plot(r: dict, out: Path) -> Path:
    """Speed-up against k, one panel per draft (stacked, readable at phone width): measured, the formula, the
    refined prediction, and plain decoding at 1."""
    import matplotlib  # heavy and optional (the course extra): only when plotting

    matplotlib.use("Agg")  # no display: figures go to files (before pyplot is imported)
    import matplotlib.pyplot as plt  # optional, as matplotlib above

    panels = [
        ("draft model (gpt2-shakespeare-draft)", r["draft_model"]),
        ("prompt lookup (text that repeats)", r["prompt_lookup"]),
    ]
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(len(panels), 1, figsize=(5.6, 4.0 * len(panels)), squeeze=False)
        for ax, (title, s) in zip(axes[:, 0], panels):
            rows = by_k(s)
            ks = [k for k, _ in rows]
            ax.axhline(1, color=ROOF, lw=1.5, ls="-")
            ax.plot(ks, [v["formula"] for _, v in rows], "--", color=TRANSFORMERS, lw=2.5, label="formula")
            ax.plot(ks, [v["refined"] for _, v in rows], ":", color="C2", lw=3, label="refined")
            ax.plot(ks, [v["speedup"] for _, v in rows], "o-", color=ENGINE, lw=2.5, label="measured")
            values = [v[key] for _, v in rows for key in ("formula", "refined", "speedup")] + [1]
            ax.set_ylim(0, 1.25 * max(values))
            ax.set_xticks(ks if len(ks) <= 8 else ks[::2])
            ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
            ax.set_xlabel("k (proposals per round)")
            ax.set_ylabel("speed-up (×)")
            ax.set_title(f"{title}\nα = {s['alpha']:.2f}, c = {s['c']:.2f}", fontsize=14)
            ax.legend(loc="upper left", ncol=3, fontsize=12, handlelength=1.5, columnspacing=0.8)
        return save(fig, out / FIGURE)


def main(
    out: Path, *, device: str = "auto", dtype: str = "float32", repeats: int = 3, sizes: Optional[Sizes] = None
) -> int:
    """`bench --speculative`: measure, then write the "speculative" section of out/bench.json (keeping its other
    sections), print the table and draw the figure."""
    sizes = sizes or Sizes(repeats=repeats)

    def report(results: dict) -> Path:
        print(table(results))
        return plot(results, out)

    return measure_and_save(out, "speculative", lambda: run(device=device, dtype=dtype, sizes=sizes), report)
