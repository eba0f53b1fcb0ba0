"""The `quanta` command line: one module per sub-command (generate, inspect, plan, quantize, convert, serve,
validate), each a few lines over the library; main.py parses and dispatches."""
