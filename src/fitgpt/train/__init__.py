"""Training: config, optimizer, checkpoints, metrics and the loop."""

from fitgpt.config import OptimConfig, TrainConfig, load_config
from fitgpt.train.trainer import TrainingError, train

__all__ = ["OptimConfig", "TrainConfig", "TrainingError", "load_config", "train"]
