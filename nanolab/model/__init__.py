"""The model: its config and presets, weights, tokenizer, layers, attention and the Llama decoder."""
