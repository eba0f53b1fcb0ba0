"""`quanta bench`: memory, speed and quality of every format of a model on one engine, with the peers at their
best: the variants (variants.py), the measurements (measure.py), the peers (peers.py), the table and charts
(report.py) and the run (pipeline.py)."""
