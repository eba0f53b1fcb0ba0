"""The names `quanta bench` takes, without importing what runs them (the command line lists them in its help)."""

DEFAULT_FORMATS = ("fp16", "bf16", "awq", "gptq", "gptq-act-order", "w8", "nf4", "fp8", "gguf:Q4_0", "gguf:Q4_K_M",
                   "gguf:Q6_K", "gguf:Q8_0")
PEERS = ("transformers", "transformers-bnb", "llama.cpp")
