"""`quanta quantize`: the pipeline (pipeline.py), its options and up-front checks (options.py,
format_check.py), the GGUF tensor stream and the summary."""
