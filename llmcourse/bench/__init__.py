"""`python -m llmcourse bench`: the engine's speed measured side by side with transformers,
CTranslate2 and this machine's roofline."""
