"""Inference: `generate.py` (the batched, KV-cached, streaming engine), `sampling.py` (the
next-token samplers), `device.py` (device and dtype resolution), `prompts.py` (prompts as given),
`session.py` (a loaded run turning prompts into completions) and `chat.py` (the REPLs)."""
