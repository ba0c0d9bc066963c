"""Serving many requests at once on the engine: `LLMEngine` (continuous batching), its scheduler, block manager and
paged KV cache; and the OpenAI-compatible HTTP server over it (`api_server`: routes and streaming, `openai_api`: the
API's requests and responses, `async_engine`: one engine stepped for many connections)."""
