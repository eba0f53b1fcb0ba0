"""Memory planning: will a model fit, from its config alone. The plan (memory_plan), what weights and KV
cost (weight_bytes, request), model shapes, the GPU table, and the start-up check the engine runs with it."""
