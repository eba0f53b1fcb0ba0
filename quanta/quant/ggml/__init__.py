"""The GGML block types: their table (types.py), decoders (blocks.py, iquants.py) and quantizers (quantize.py,
kquantize.py, qsearch.py), bit-exact with llama.cpp's."""
