"""LoPA: lookahead parallel decoding for D2F diffusion language models."""

__version__ = "0.1.0"
