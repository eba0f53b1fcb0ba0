"""The model architectures the engine builds (the llama family)."""
