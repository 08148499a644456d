"""Training the bundled model from scratch with D2F's block-wise masked-diffusion objective."""

from lopa.training.config import TrainConfig, model_config
from lopa.training.loop import train

__all__ = ["TrainConfig", "model_config", "train"]
