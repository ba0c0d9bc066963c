"""Structured output: constraints (a regex, a choice, a JSON schema) compiled to automata over bytes, and the index
from (state, token) to the next state that masks a model's logits at each step."""
