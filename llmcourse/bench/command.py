"""`python -m llmcourse bench`: the command's `main`, which runs one benchmark: the serving one (`--serving`),
the speculative decoding one (`--speculative`), the quantization one (`--quantize`), the HTTP server against the
engine in-process (`--http`), structured output's cost (`--structured`), the prepared GPU check (`--gpu-suite`), or
else the speed one (the engine against transformers and this machine's roofline)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import gpu_suite, http, quantize, serving, speculative, speed, structured


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if getattr(args, "serving", None):
        return serving.main(args.serving, out, device=args.device, dtype=args.dtype)
    if getattr(args, "http", None):
        return http.main(out, model=args.http, device=args.device, dtype=args.dtype)
    if getattr(args, "speculative", False):
        return speculative.main(out, device=args.device, dtype=args.dtype, repeats=args.repeats)
    if getattr(args, "tiny", False) and not getattr(args, "gpu_suite", False):
        print("python -m llmcourse bench: error: --tiny goes with --gpu-suite", file=sys.stderr)
        return 2
    if getattr(args, "structured", False):
        return structured.main(out, device=args.device, repeats=args.repeats)
    if getattr(args, "gpu_suite", False):
        return gpu_suite.main(out, device=args.device, tiny=args.tiny)
    if getattr(args, "quantize", False):
        return quantize.main(out, device=args.device, dtype=args.dtype, repeats=args.repeats, model=args.model)
    return speed.main(args)
