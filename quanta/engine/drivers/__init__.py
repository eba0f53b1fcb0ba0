"""The drivers of an EngineCore that the server runs (AsyncEngine in-process, ProcessEngine with the core in
a process of its own), behind the EngineClient protocol (client.py), with their serving statistics."""
