"""Inference: the KV-cached generation engine, its samplers, device choice, prompts, sessions, REPLs."""
