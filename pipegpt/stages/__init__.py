"""Which layers go to which stage, and the Stage that runs one microbatch's forward and backward."""
from .partition import partition_layers
from .stage import Stage

__all__ = ["Stage", "partition_layers"]
