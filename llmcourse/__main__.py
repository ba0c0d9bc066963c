"""Command line.

$ python -m llmcourse generate "ROMEO:"          # stream a continuation (bundled model)
$ python -m llmcourse generate --parts chapters/ "ROMEO:"   # ... with your own functions in the engine
$ python -m llmcourse chat --model llama-shakespeare  # a conversation through the model's chat template
$ python -m llmcourse serve                      # an OpenAI-compatible server and a chat page at http://127.0.0.1:8000
$ python -m llmcourse serve --parts chapters/    # ... serving your own engine
$ python -m llmcourse progress [PATH]            # a learner's dashboard
$ python -m llmcourse release                    # regenerate chapters/ from solutions/
$ python -m llmcourse bench                      # engine vs transformers vs the roofline
$ python -m llmcourse bench --serving            # static batching vs LLMEngine, prefix caching
$ python -m llmcourse bench --speculative        # plain vs speculative decoding (draft model, prompt lookup)
$ python -m llmcourse bench --quantize           # float32 / int8 / int4 vs transformers and CTranslate2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import torch

from .bench.command import main as bench
from .course.learner import slots_used, your_pieces
from .course.progress import default_folder, progress_lines
from .engine.checkpoints import read_config
from .engine.config import CheckpointError
from .engine.generate import NUM_DRAFT_TOKENS, CompileError, stream
from .engine.hf_tokenizer import ChatTemplateError, HFTokenizer, load_tokenizer
from .engine.loading import load_model, resolve_source, save_model
from .engine.quantize import resident_bytes
from .engine.sampling import SamplingParams
from .engine.slots import PartError
from .engine.speculative import SpeculationStats
from .engine.structured.constraint import compile_constraint
from .engine.tokenizer import EOT_ID, TokenizerFileError
from .serving.llm_engine import MAX_NUM_SEQS, LLMEngine


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad option prints one line (no usage dump) and exits with status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


TEMPERATURE = 0.8  # the command line samples by default (greedy with --num-beams > 1)
CHAT_MODEL = "llama-shakespeare"  # the bundled chat model (its template makes a conversation a scene)
EXIT = ("/exit", "/quit")

# The library's keyword arguments and the flags that set them, to say errors in flag terms.
FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "logit_bias": "--logit-bias",
    "num_beams": "--num-beams",
    "length_penalty": "--length-penalty",
    "num_draft_tokens": "--num-draft-tokens",
    "quantize": "--quantize",
}


def in_flag_terms(message: str) -> str:
    """A library error message with its keyword arguments named as the flags that set them:
    'with num_beams > 1 use temperature=0' -> 'with --num-beams > 1 use --temperature 0'."""
    message = message.replace("compile=True", "--compile").replace("or compile=False", "or leave out --compile")
    message = message.replace("(draft=...)", "(--draft)").replace("or the draft", "or --draft")
    message = message.replace("draft='prompt-lookup'", "--draft prompt-lookup").replace("the draft model ", "--draft ")
    for name, flag in FLAGS.items():
        message = re.sub(rf"(?<![\w-]){name}=([^\s,;:)]+)", rf"{flag} \1", message)
        message = re.sub(rf"(?<![\w-]){name}(?!\w)", flag, message)
    return message


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m llmcourse", description="LLM inference from scratch: the GPT-2 engine.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    gen = commands.add_parser(
        "generate",
        help="stream a continuation of a prompt",
        description="Stream the model's continuation of PROMPT to stdout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    gen.add_argument("prompt", metavar="PROMPT", help="the text to continue")
    gen.add_argument(
        "--model",
        default="gpt2-shakespeare",
        help="a bundled model (gpt2-shakespeare, gpt2-shakespeare-draft), a folder with config.json + "
        "model.safetensors, or a Hugging Face Hub name (e.g. gpt2) taken from the local cache",
    )
    add_settings(gen)
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="structured output: the text is JSON valid for the JSON schema in FILE (a subset: objects, arrays, "
        "strings, numbers, enum, const, ...; another keyword is refused by name)",
    )
    shape.add_argument("--regex", metavar="PATTERN", default=None, help="structured output: the text matches PATTERN")
    shape.add_argument(
        "--choice", metavar="TEXT", nargs="+", default=None, help="structured output: the text is one of these"
    )
    gen.add_argument(
        "--draft",
        metavar="MODEL",
        default=argparse.SUPPRESS,
        help="speculative decoding: a draft model (a --model value with the same tokenizer, e.g. "
        "gpt2-shakespeare-draft) or 'prompt-lookup' (proposals copied from earlier in the text) "
        "proposes tokens that the model checks several at a time; same text when greedy, same "
        "distribution when sampling; a summary goes to stderr",
    )
    gen.add_argument(
        "--num-draft-tokens",
        type=draft_tokens,
        default=NUM_DRAFT_TOKENS,
        metavar="K",
        help="with --draft: tokens proposed per round, or 'auto' (chosen as it goes from the acceptance rate)",
    )
    gen.add_argument(
        "--parts",
        metavar="FOLDER",
        default=argparse.SUPPRESS,
        help="run your own engine: your functions from the chapter notebooks in FOLDER (e.g. chapters/; "
        "the saved notebooks) wherever their checks pass, the engine's own elsewhere (notices on "
        "stderr say which)",
    )
    chat = commands.add_parser(
        "chat",
        help="talk with a chat model in the terminal",
        description="A conversation with a chat model: each line you type (stdin) is your turn, the model's "
        "reply streams to stdout; the whole conversation goes through the model's chat template each turn. "
        "/exit or end of input (Ctrl+D) ends it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    chat.add_argument(
        "--model",
        default=CHAT_MODEL,
        help="a model with a chat template (in tokenizer_config.json): a bundled one, a folder as transformers' "
        "save_pretrained writes it, or a Hugging Face Hub name taken from the local cache",
    )
    chat.add_argument("--system", metavar="TEXT", default=None, help="a system message to open the conversation")
    add_settings(chat)
    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server and a chat page",
        description="Serve MODEL over HTTP with the OpenAI API (POST /v1/completions, /v1/chat/completions, "
        "streaming or not; GET /v1/models, /health; vLLM's POST /tokenize, /detokenize and GET /metrics for "
        "Prometheus) and a chat page at /. All requests share one LLMEngine "
        "(continuous batching over a paged KV cache). Ctrl+C stops it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument(
        "--model",
        default=CHAT_MODEL,
        help="any --model of generate; the chat route needs a chat template (tokenizer_config.json's)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every network)")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on the /v1 routes, /tokenize, /detokenize and /metrics",
    )
    serve.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, metavar="N", help="requests decoded at once")
    serve.add_argument(
        "--max-pending",
        type=int,
        default=256,
        metavar="N",
        help="requests held at once (running or waiting); more get 429 Too Many Requests",
    )
    serve.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGINS",
        help="comma-separated web origins (https://example.org, or *) whose pages may call the server from a "
        "browser (CORS); by default none: a request from another site's page gets 403 (the chat page is same-origin)",
    )
    serve.add_argument(
        "--receive-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="seconds in which a request's headers and body must arrive; a slower one gets 408 and is closed",
    )
    serve.add_argument(
        "--keep-alive", type=float, default=5.0, metavar="S", help="seconds an idle connection stays open"
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        metavar="S",
        help="on SIGINT/SIGTERM, seconds requests in flight get to finish; then each stream gets an error event "
        "and [DONE], each other request a 503",
    )
    serve.add_argument(
        "--parts",
        metavar="FOLDER",
        default=argparse.SUPPRESS,
        help="serve your own engine: your functions from the chapter notebooks in FOLDER (e.g. chapters/) wherever "
        "their checks pass, the engine's own elsewhere (notices on stderr say which)",
    )
    serve.add_argument("--device", default="auto", metavar="D", help="auto, cpu, cuda or cuda:N")
    serve.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    serve.add_argument("--quantize", choices=["int8", "int4"], default=None, help="quantize the weights")
    serve.add_argument(
        "--compile",
        action="store_true",
        help="run the engine's decode-only steps as compiled graphs, one per batch-size bucket (CUDA graphs on a "
        "GPU); each bucket compiles at its first step",
    )
    prog = commands.add_parser(
        "progress",
        help="your dashboard: which exercises pass, with points",
        description="Run the checks of your chapter notebooks on your functions. It reads the saved notebooks: save "
        "yours in JupyterLab first (Ctrl+S). It runs the setup cells, the exercise cells and every other "
        "cell that only defines things (imports, def, class, assignments), then each check.",
    )
    prog.add_argument(
        "folder",
        nargs="?",
        default=None,
        metavar="PATH",
        help="your chapters folder (holding NN_topic/NN_topic.ipynb), one chapter's folder, or a "
        "notebook (default: ./chapters)",
    )
    prog.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show each failing check's whole message (input, expected, got, hint)",
    )
    quant = commands.add_parser(
        "quantize",
        help="quantize a model's weights and save them (int8 or int4)",
        description="Load MODEL, quantize its linear layers and token table to FORMAT and save the result to OUT "
        "(config.json + model.safetensors); then run it with `generate --model OUT`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    quant.add_argument("format", choices=["int8", "int4"], metavar="FORMAT", help="int8 or int4")
    quant.add_argument("--model", default="gpt2-shakespeare", help="any --model of generate")
    quant.add_argument("--out", required=True, metavar="FOLDER", help="the folder to write")
    release = commands.add_parser(
        "release",
        help="regenerate chapters/ from solutions/ with nbgrader (instructors)",
        description="Run `nbgrader generate_assignment NAME --notebook=NAME --force` for every chapter in solutions/ "
        "(or the chapters named), recording each in the gradebook so that `nbgrader autograde` finds it; "
        "run it in the course folder (where nbgrader_config.py is).",
    )
    release.add_argument("names", nargs="*", metavar="NN_topic", help="only these chapters (default: all)")
    bench = commands.add_parser(
        "bench",
        help="benchmark the engine against transformers and this machine's roofline",
        description="Measure decode and prefill speed (engine vs transformers, same weights), the roofline, the KV "
        "cache and batching; print a table and write bench.json and one figure per measurement "
        "(bench_*.png).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_argument(
        "--model",
        default="gpt2",
        help="'gpt2' (124M configuration, random weights: no download), 'tiny', or any --model of generate",
    )
    bench.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    bench.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    bench.add_argument("--prompt-len", type=int, default=128, metavar="N", help="prompt length for decode")
    bench.add_argument("--new-tokens", type=int, default=128, metavar="N", help="tokens to generate for decode")
    bench.add_argument("--prefill-lens", type=int_list, default=[128, 512, 1024], metavar="N,N,...")
    bench.add_argument(
        "--contexts",
        type=int_list,
        default=[128, 512, 1024],
        metavar="N,N,...",
        help="context lengths for KV cache vs recompute",
    )
    bench.add_argument("--batch-sizes", type=int_list, default=[1, 4, 16, 32], metavar="N,N,...")
    bench.add_argument("--repeats", type=int, default=3, metavar="R", help="interleaved repeats; medians are reported")
    bench.add_argument("--no-transformers", action="store_true", help="skip the transformers comparison")
    bench.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the compiled rows (torch.compile, + CUDA graphs on a GPU; compiling takes ~1 min)",
    )
    bench.add_argument(
        "--tiny",
        action="store_true",
        help="with --gpu-suite: its logic on a tiny model, in seconds, on any device (the figures mean nothing)",
    )
    bench.add_argument(
        "--out", default="bench", metavar="DIR", help="where to write bench.json and the figures (bench_*.png)"
    )
    instead = bench.add_mutually_exclusive_group()
    instead.add_argument(
        "--serving",
        nargs="?",
        const=["gpt2-shakespeare", "gpt2"],
        type=name_list,
        metavar="MODEL,...",
        default=argparse.SUPPRESS,
        help="instead, run the serving benchmark (static batching vs LLMEngine, prefix caching) on these "
        "models (without a value: gpt2-shakespeare,gpt2); it writes the 'serving' section of "
        "bench.json and bench_serving.png",
    )
    instead.add_argument(
        "--speculative",
        action="store_true",
        help="instead, run the speculative decoding benchmark (gpt2-shakespeare with its draft model "
        "and with prompt lookup, k = 1...8, against plain greedy decoding; uses --device, --dtype, "
        "--repeats); it writes the 'speculative' section of bench.json and bench_speculative.png",
    )
    instead.add_argument(
        "--quantize",
        action="store_true",
        help="instead, run the quantization benchmark (the engine in float32, int8 and int4 against "
        "transformers and CTranslate2, batch 1 and 16, each against its roofline; uses --model "
        "(a configuration: random weights), --device, --repeats; float32 only); it writes the 'quantize' section "
        "of bench.json and bench_quantize.png",
    )
    instead.add_argument(
        "--structured",
        action="store_true",
        help="instead, run the structured output benchmark (both bundled models at batch 1 and 16: a decode step "
        "free and constrained by a JSON string, the overhead; a 7-property schema's index build over GPT-2's "
        "vocabulary beside outlines-core's; uses --device, --repeats); it writes the 'structured' section of "
        "bench.json and bench_structured.png",
    )
    instead.add_argument(
        "--gpu-suite",
        action="store_true",
        help="instead, run the prepared GPU check (under 5 minutes with compilation: the CUDA tests, batch-1 "
        "decode of Llama-3-8B- and Llama-3.2-1B-shaped random models in bfloat16, int8 and int4 with MBU, batches "
        "of 16 and 64, LLMEngine at 64 requests with and without CUDA graphs, paged attention's routes, the "
        "capstone's table; uses --device); it prints markdown tables and writes gpu_suite.md and the 'gpu_suite' "
        "section of bench.json",
    )
    instead.add_argument(
        "--http",
        nargs="?",
        const="llama-shakespeare",
        metavar="MODEL",
        default=argparse.SUPPRESS,
        help="instead, run the HTTP benchmark: `serve` in a subprocess against AsyncEngine in-process, the "
        "same requests at 1, 4, 16 and 32 concurrent clients, on this model (without a value: llama-shakespeare; "
        "uses --device, --dtype); it writes the 'http' section of bench.json and bench_http.png",
    )
    return parser


def add_settings(parser: argparse.ArgumentParser) -> None:
    """The flags of generation's settings (sampling, length, stop, seed, device, precision), for `generate`
    and `chat` alike."""
    parser.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="generate at most N tokens")
    parser.add_argument(
        "--temperature",
        type=float,
        default=argparse.SUPPRESS,
        metavar="T",
        help=f"sampling temperature; 0 = greedy (always the most likely token) (default: {TEMPERATURE:g}, "
        "or 0 with --num-beams > 1: beam search is greedy)",
    )
    parser.add_argument(
        "--top-k", type=int, default=0, metavar="K", help="sample only from the K most likely tokens; 0 = off"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        metavar="P",
        help="sample only from the most likely tokens whose probabilities sum to P, in (0, 1]; 1 = off",
    )
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="P",
        help="drop tokens less likely than P times the most likely one, in [0, 1]; 0 = off",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        metavar="R",
        help="> 1 makes tokens already in the text less likely; 1 = off",
    )
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        metavar="P",
        help="OpenAI's: subtract P from the logit of every token generated so far, in [-2, 2]; 0 = off",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        metavar="F",
        help="OpenAI's: subtract F times its count from the logit of every token generated so far, in [-2, 2]; 0 = off",
    )
    parser.add_argument(
        "--logit-bias",
        type=logit_bias_entry,
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS, in [-100, 100], to token ID's logit (repeat the option for several; -100 bans the token)",
    )
    parser.add_argument(
        "--num-beams",
        type=int,
        default=1,
        metavar="B",
        help="beam search with B beams (greedy: --temperature 0, the default with beams); 1 = off",
    )
    parser.add_argument(
        "--length-penalty",
        type=float,
        default=1.0,
        metavar="L",
        help="beam search: finished beams score sum(logprob) / length**L",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop before this text (repeat the option for several)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="random seed: the same seed gives the same text"
    )
    parser.add_argument("--device", default="auto", metavar="D", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="weight precision"
    )
    parser.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        default=None,
        help="weights in 8 bits (a scale per output row) or 4 bits (groups of 32, Q4_0): less memory, "
        "faster decoding; a model folder saved quantized loads as it is",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run each decode step as one torch.compile'd graph (a CUDA graph on a GPU); "
        "compiling takes a while before the first token",
    )


def logit_bias_entry(text: str) -> tuple[int, float]:
    """--logit-bias ID=BIAS: a token id and a number (the library checks their ranges)."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS such as 50256=-100, got {text!r}") from None


def draft_tokens(text: str):
    """--num-draft-tokens: an integer (the library checks its range) or 'auto'."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens or 'auto', got {text!r}") from None


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated model names, got {text!r}")
    return names


def run_progress(args: argparse.Namespace) -> int:
    try:
        for line in progress_lines(default_folder() if args.folder is None else args.folder, verbose=args.verbose):
            print(line, flush=True)
    except FileNotFoundError as err:
        print(f"python -m llmcourse progress: error: {err}", file=sys.stderr)
        return 2
    return 0


def run_release(names: list[str]) -> int:
    from .course.grading import release  # nbgrader: an instructor's tool, not a dependency of the package

    return release(names=names or None)


def run_generate(args: argparse.Namespace) -> int:
    def fail(message: str, code: int) -> int:
        print(f"python -m llmcourse generate: error: {message}", file=sys.stderr)
        return code

    if not args.prompt:
        return fail(
            'PROMPT is empty: give some text to continue, e.g. "ROMEO:" (to start from nothing, '
            'give "<|endoftext|>", the token GPT-2 saw between documents)',
            2,
        )
    if any(not s for s in args.stop):
        return fail("--stop needs a non-empty text", 2)
    temperature = getattr(args, "temperature", 0.0 if args.num_beams > 1 else TEMPERATURE)
    settings = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias),
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        stop=args.stop,
        seed=args.seed,
        compile=args.compile,
    )
    stats = None
    if hasattr(args, "draft"):
        stats = SpeculationStats()
        settings |= dict(draft=args.draft, num_draft_tokens=args.num_draft_tokens, stats=stats)
    try:
        tokenizer, yours = load_tokenizer(args.model), None
        vocabulary = tokenizer  # what a constraint's index is built over (chapter 01's tokenizer has the same tokens)
        settings["eos_token_id"] = eos_of(tokenizer)
        if hasattr(args, "parts"):
            constrained = dict(json_schema=args.json_schema, regex=args.regex, choice=args.choice)
            yours = your_pieces(
                args.parts,
                notify=lambda line: print(line, file=sys.stderr, flush=True),
                uses=slots_used({**settings, **constrained, "quantize": args.quantize}, model_type_of(args.model)),
                beyond=any(v is not None for v in constrained.values()),  # chapter 13's functions for a constraint
            )
            if not isinstance(tokenizer, HFTokenizer):  # chapter 01's tokenizer is GPT-2's
                tokenizer = yours.tokenizer
        # with --parts, the learner's loader (chapter 11) reads a Llama-family checkpoint, and the learner's
        # quantization functions (chapter 09) quantize the model once installed
        model = load_model(
            args.model,
            device=args.device,
            dtype=args.dtype,
            quantize=None if yours else args.quantize,
            parts=None if yours is None else yours.parts,
        )
        if yours is not None:
            model = yours.install(model, args.quantize)  # an Engine: generation runs the learner's functions
        settings["constraint"] = constraint_of(args, vocabulary, None if yours is None else yours.structuring)
        pieces = stream(model, tokenizer, args.prompt, **settings)
        first = next(pieces, "")  # bad settings raise here, before anything is printed
    except FileNotFoundError as err:  # --parts names no chapters
        return fail(f"--parts: {err}", 2)
    except ValueError as err:  # CheckpointError is a ValueError too
        return fail(in_flag_terms(str(err)), 1 if isinstance(err, CheckpointError) else 2)
    except (TokenizerFileError, PartError) as err:
        return fail(str(err), 1)
    sys.stdout.write(first)
    sys.stdout.flush()
    try:
        for piece in pieces:
            sys.stdout.write(piece)
            sys.stdout.flush()
    except CompileError as err:  # compiling starts at the second token, after the first is shown
        print(f"\npython -m llmcourse generate: error: {err}", file=sys.stderr)
        return 1
    except PartError as err:  # a part of yours (--parts) that fails on this input
        print(f"\npython -m llmcourse generate: error: {err}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats is not None:
        print(stats.summary(), file=sys.stderr)
    return 0


def constraint_of(args: argparse.Namespace, tokenizer, structuring=None):
    """The compiled constraint of --json-schema / --regex / --choice, or None (compiled and followed with
    `structuring`'s functions: with --parts, chapter 13's)."""
    if args.json_schema is not None:
        try:
            schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
        except OSError as err:
            raise ValueError(f"--json-schema: cannot read {args.json_schema}: {err.strerror}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"--json-schema: {args.json_schema} is not JSON: {err}") from None
        try:
            return compile_constraint(tokenizer, json_schema=schema, structuring=structuring)
        except ValueError as err:
            raise ValueError(f"--json-schema: {err}") from None
    for flag, name, value in (("--regex", "regex", args.regex), ("--choice", "choice", args.choice)):
        if value is not None:
            try:
                return compile_constraint(tokenizer, **{name: value}, structuring=structuring)
            except ValueError as err:
                raise ValueError(f"{flag}: {err}") from None
    return None


def model_type_of(source) -> str:
    """config.json's model_type of a model source ('gpt2' where it cannot be read: loading it says why)."""
    try:
        return read_config(resolve_source(source)).get("model_type", "gpt2")
    except (CheckpointError, OSError):
        return "gpt2"


def eos_of(tokenizer):
    """The id(s) that end a reply: the model folder's (Llama 3 has several), or GPT-2's <|endoftext|>."""
    ids = tuple(getattr(tokenizer, "eos_token_ids", None) or (EOT_ID,))
    return ids[0] if len(ids) == 1 else ids


def chat_ids(tokenizer: HFTokenizer, messages: list[dict], room: int) -> list[int]:
    """The conversation's token ids, at most `room`: the oldest turns after the system message are forgotten
    (removed from `messages`, with a notice) until it fits. A last message too long even alone is refused."""
    first = 1 if messages[0]["role"] == "system" else 0
    alone = len(tokenizer.encode_chat(messages[:first] + messages[-1:]))
    if alone > room:
        raise ValueError(
            f"this message takes {alone} tokens in the chat template, but the model has room for {room} "
            "(its positions less --max-new-tokens): shorten it or lower --max-new-tokens"
        )
    while len(ids := tokenizer.encode_chat(messages)) > room:
        del messages[first : first + 2]  # one user turn and the reply to it
        print("(the conversation no longer fits the model: its oldest turn is forgotten)", file=sys.stderr)
    return ids


def read_turn(interactive: bool):
    """The user's next line, or None at the end of input."""
    try:
        return input("> ") if interactive else next(sys.stdin).rstrip("\n")
    except (EOFError, StopIteration):
        return None


def run_chat(args: argparse.Namespace) -> int:
    def fail(message: str, code: int) -> int:
        print(f"python -m llmcourse chat: error: {message}", file=sys.stderr)
        return code

    if any(not s for s in args.stop):
        return fail("--stop needs a non-empty text", 2)
    settings = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=getattr(args, "temperature", 0.0 if args.num_beams > 1 else TEMPERATURE),
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=dict(args.logit_bias),
        num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        stop=tuple(args.stop),
    )
    try:
        params = SamplingParams(**settings)  # bad settings fail here, before the conversation starts
        tokenizer = load_tokenizer(args.model)
        if getattr(tokenizer, "chat_template", None) is None:
            return fail(
                f"{args.model} has no chat template (tokenizer_config.json's chat_template), so it cannot "
                f"chat: use a chat model (--model {CHAT_MODEL}, or a folder of an instruct model), or continue "
                "text with: python -m llmcourse generate --model MODEL PROMPT",
                2,
            )
        model = load_model(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize)
        params = dataclasses.replace(params, eos_token_id=eos_of(tokenizer))
        generator = torch.Generator(device=model.device).manual_seed(args.seed)  # one for the whole conversation
    except ValueError as err:  # CheckpointError is a ValueError too
        return fail(in_flag_terms(str(err)), 1 if isinstance(err, CheckpointError) else 2)
    except TokenizerFileError as err:
        return fail(str(err), 1)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    room = model.config.n_positions - args.max_new_tokens
    while (line := read_turn(interactive)) is not None and line.strip() not in EXIT:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids = chat_ids(tokenizer, messages, room)
            pieces = stream(model, tokenizer, ids, params, generator=generator, compile=args.compile)  # BOS once
            reply = ""
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
                reply += piece
        except ChatTemplateError as err:
            return fail(str(err), 1)
        except CompileError as err:
            return fail(str(err), 1)
        except ValueError as err:  # this message alone is longer than the model can take: say so, go on
            print(f"python -m llmcourse chat: {in_flag_terms(str(err))}", file=sys.stderr)
            messages.pop()
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": reply})
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from .serving.api_server import build_app, serve  # the web stack loads only for this command
    from .serving.untrusted import check_origins

    def fail(message: str, code: int) -> int:
        print(f"python -m llmcourse serve: error: {message}", file=sys.stderr)
        return code

    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-pending", args.max_pending)):
        if value < 1:
            return fail(f"{flag} must be at least 1, got {value}", 2)
    if not 0 <= args.port < 65536:
        return fail(f"--port must be in 0 ... 65535, got {args.port}", 2)
    for flag, value, least in (("--receive-timeout", args.receive_timeout, 0.1), ("--keep-alive", args.keep_alive, 0.1),
                               ("--shutdown-grace", args.shutdown_grace, 0)):  # fmt: skip
        if not least <= value < float("inf"):
            return fail(f"{flag} must be a number of seconds >= {least}, got {value}", 2)
    try:
        origins = check_origins(o for o in args.allowed_origins.split(",") if o.strip())
    except ValueError as err:
        return fail(f"--allowed-origins: {err}", 2)
    try:
        structuring = None
        if hasattr(args, "parts"):  # an Engine: LLMEngine runs the learner's parts, sampler and batching functions
            notify = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
            pieces = your_pieces(args.parts, notify=notify, beyond=True)  # chapter 13's for requests' constraints
            model = pieces.engine(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize)
            tokenizer, structuring = model.tokenizer, pieces.structuring  # chapter 01's for GPT-2 (a Llama's own)
        else:
            tokenizer = load_tokenizer(args.model)
            model = load_model(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize)
        engine = LLMEngine(model, max_num_seqs=args.max_num_seqs, tokenizer=tokenizer, compile=args.compile)
    except FileNotFoundError as err:  # --parts names no chapters
        return fail(f"--parts: {err}", 2)
    except ValueError as err:  # CheckpointError is a ValueError too
        return fail(in_flag_terms(str(err)), 1 if isinstance(err, CheckpointError) else 2)
    except (TokenizerFileError, PartError) as err:  # PartError: the learner's loader failed on this checkpoint
        return fail(str(err), 1)
    name = str(args.model)
    app = build_app(
        engine,
        tokenizer,
        name,
        api_key=args.api_key,
        max_pending=args.max_pending,
        allowed_origins=origins,
        structuring=structuring,
    )
    url = f"http://{args.host}:{args.port}"
    print(f"serving {name} at {url}/v1 (OpenAI API); chat page: {url}/ ; Ctrl+C stops", file=sys.stderr, flush=True)
    try:
        serve(
            app,
            args.host,
            args.port,
            keep_alive=args.keep_alive,
            receive_timeout=args.receive_timeout,
            shutdown_grace=args.shutdown_grace,
        )
    except OSError as err:  # the port is taken, say
        return fail(f"cannot listen on {args.host}:{args.port} ({err}): choose another --port", 1)
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    try:
        model = load_model(args.model, device="cpu", quantize=args.format)
    except ValueError as err:  # CheckpointError too
        print(f"python -m llmcourse quantize: error: {in_flag_terms(str(err))}", file=sys.stderr)
        return 1
    folder = save_model(model, args.out)
    size = resident_bytes(model)
    print(
        f"{args.model} quantized to {args.format}: {size / 1e6:.1f} MB of weights, saved to {folder}; "
        f"run it with: python -m llmcourse generate --model {folder} PROMPT"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "chat":
            return run_chat(args)
        if args.command == "serve":
            return run_serve(args)
        if args.command == "progress":
            return run_progress(args)
        if args.command == "quantize":
            return run_quantize(args)
        if args.command == "release":
            return run_release(args.names)
        if args.command == "bench":
            return bench(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
        sys.stdout = None
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
