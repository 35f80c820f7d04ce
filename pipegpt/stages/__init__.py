"""Which layers go to which stage (pipegpt.model.partition, torch-free), and the Stage that runs one microbatch's forward and backward."""
from pipegpt.model.partition import partition_layers
from .stage import Stage

__all__ = ["Stage", "partition_layers"]
