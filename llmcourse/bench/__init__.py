"""`python -m llmcourse bench`: the engine's speed measured side by side with transformers,
CTranslate2 and this machine's roofline.

`command` (the command's `main`) runs one of `speed` (the default), `serving`, `speculative` and
`quantize`; what they share (the machine, the roofline, bench.json, the figures' style) is in `common`."""
