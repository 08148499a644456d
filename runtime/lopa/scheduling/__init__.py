"""Continuous batching: many requests advance one LoPA round per batched forward."""
