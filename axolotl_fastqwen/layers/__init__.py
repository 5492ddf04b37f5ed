"""Replacement forwards for the stock Qwen hybrid modules, installed per instance by `patching`."""
