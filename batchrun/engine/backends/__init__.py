"""Model backends (text, vision), their batches, prompts and tokens. They import anything in the
engine but its core (engine.py, generate.py, cache_control.py, load.py, vision_engine.py)."""
