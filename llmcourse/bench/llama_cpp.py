"""llama.cpp in `bench --quantize`: the engine's GPT-2 weights written as GGUF files (llama.cpp's format) with the
`gguf` package, and run through llama-cpp-python, at batch 1.

Both packages are optional and never in requirements.txt: PyPI has no wheel of llama-cpp-python, so pip builds it
from source with cmake, about 15-30 minutes on 2 cores (benchmarks.md, "Quantization", says how). Where either is
missing, the llama.cpp rows are skipped with one line.

The files: GPT-2's tensors under llama.cpp's names (`token_embd`, `blk.N.attn_qkv`, ...), each linear weight as
llama.cpp stores it ([C_out, C_in], the transpose of GPT-2's Conv1D), the tokenizer's byte-level tokens and merges;
"f32" keeps every tensor in float32, "q8_0" stores the linear weights and the token table in llama.cpp's Q8_0
(blocks of 32 int8 values with a float16 scale: 34 bytes per 32 weights), norms, biases and positions in float32,
as llama.cpp's own converter (convert_hf_to_gguf.py) writes them.

    >>> GGUF_TYPES["int8"], default_threads(cores=2)
    ('q8_0', 1)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import torch

from llmcourse.engine.tokenizer import vocab_files

GGUF_TYPES = {"float32": "f32", "int8": "q8_0"}  # the engine's format -> the GGUF file type that matches it
NOT_INSTALLED = (
    "llama.cpp is not installed (pip install llama-cpp-python gguf: built from source, see benchmarks.md): "
    "its rows are skipped"
)


def modules():
    """(llama_cpp, gguf), or None where either is not installed."""
    try:
        import gguf  # optional: only to write the files
        import llama_cpp  # optional: built from source
    except ImportError:
        return None
    return llama_cpp, gguf


def default_threads(cores: Optional[int] = None) -> int:
    """The threads llama-cpp-python computes with when not told: half the machine's CPUs, at least one."""
    return max((os.cpu_count() if cores is None else cores) // 2, 1)


def write_gguf(gguf, model, path: Path, file_type: str) -> Path:
    """The GPT-2 `model` (the engine's) as a GGUF file of `file_type` ("f32" or "q8_0") at `path`."""
    cfg = model.config
    q8 = file_type == "q8_0"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_block_count(cfg.n_layer)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.ALL_F32)
    encoder = json.loads(Path(vocab_files()["encoder.json"]).read_text())  # token string -> id
    tokens = sorted(encoder, key=encoder.get)
    merges = Path(vocab_files()["vocab.bpe"]).read_text(encoding="utf-8").splitlines()[1:]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m for m in merges if m])
    writer.add_bos_token_id(encoder["<|endoftext|>"])
    writer.add_eos_token_id(encoder["<|endoftext|>"])

    def add(name: str, t: torch.Tensor, quantize: bool = False) -> None:
        data = t.detach().float().contiguous().numpy()
        if quantize and q8:
            writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", model.wte.weight, quantize=True)
    add("position_embd.weight", model.wpe.weight)
    for i, block in enumerate(model.h):
        for ours, theirs in (("ln_1", "attn_norm"), ("ln_2", "ffn_norm")):
            norm = getattr(block, ours)
            add(f"blk.{i}.{theirs}.weight", norm.weight)
            add(f"blk.{i}.{theirs}.bias", norm.bias)
        for layer, theirs in (
            (block.attn.c_attn, "attn_qkv"),
            (block.attn.c_proj, "attn_output"),
            (block.mlp.c_fc, "ffn_up"),
            (block.mlp.c_proj, "ffn_down"),
        ):
            add(f"blk.{i}.{theirs}.weight", layer.weight.T, quantize=True)  # [C_out, C_in]
            add(f"blk.{i}.{theirs}.bias", layer.bias)
    add("output_norm.weight", model.ln_f.weight)
    add("output_norm.bias", model.ln_f.bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def decoder(llama_cpp, path: Path, threads: int, context: int):
    """decode(prompts, n) for `bench.quantize.Row`: one prompt (batch 1), greedy, n new tokens -> (tokens, seconds
    of the whole call, seconds from the first token to the last)."""
    llm = llama_cpp.Llama(
        str(path), n_ctx=context, n_batch=context, n_threads=threads, n_threads_batch=threads, verbose=False
    )

    def decode(prompts, n):
        (prompt,) = prompts
        tokens, stamps = [], []
        start = time.perf_counter()
        for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            stamps.append(time.perf_counter())
            if len(tokens) == n:
                break
        return [tokens], stamps[-1] - start, stamps[-1] - stamps[0]

    return decode
