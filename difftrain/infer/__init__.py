"""Inference: `generate.py` (the batched, KV-cached, streaming engine), `sampling.py` (the
next-token samplers) and `device.py` (device and dtype resolution)."""
