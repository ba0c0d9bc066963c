"""Serving many requests at once on the engine: `LLMEngine` (continuous batching), its scheduler,
block manager and paged KV cache."""
