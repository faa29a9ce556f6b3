"""Training: the loop, distributed setup, checkpoints, schedules and metrics."""

from .checkpoint import CheckpointError, latest_valid_checkpoint, load_trainer_state, save_checkpoint, verify_checkpoint
from .distributed import DistInfo, setup_distributed, wrap_model
from .loop import TrainConfig, parse_budget, train

__all__ = [
    "CheckpointError", "DistInfo", "TrainConfig", "latest_valid_checkpoint", "load_trainer_state", "parse_budget",
    "save_checkpoint", "setup_distributed", "train", "verify_checkpoint", "wrap_model",
]
