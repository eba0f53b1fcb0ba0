"""GGUF files: the container (file.py), the reader and writer, the per-tensor type assignment of mixes
(mix.py) and the tokenizer vocabulary (vocab.py)."""
