"""`quanta convert`: the pipeline (pipeline.py), per-tensor rules (rules.py, rows.py), the targets (target.py),
the report and the staged output."""
