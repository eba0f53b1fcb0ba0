"""Tensor parallelism: every rank builds the same EngineCore over its shard (models/llama.py says what each
layer holds); rank 0 alone schedules and samples, broadcasts each step (step.py), and the other ranks run it
(ModelRunner.serve, rank.py for the ranks quanta spawns) until rank 0 closes. group.py is the process group
and its collectives, one_shot.py the small all-reduces of decode as one kernel over symmetric memory.
"""
