"""The inference engine: GPT-2's network, its tokenizer and weights, and the drivers that run it
(generation, beam search, speculative decoding, quantization). It imports nothing from the serving
stack, the benchmarks, the course or the checks."""
