"""`quanta convert`'s defaults, importable without torch (the command line shows them in its help)."""

DEFAULT_SHARD_SIZE = "1GB"        # the output shard buffered in memory: a term of the memory bound
DEFAULT_WINDOWS, DEFAULT_CTX = 4, 512
DEFAULT_GROUP = 128               # the group size of re-quantized integer weights when the source fixes none
