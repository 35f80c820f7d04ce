"""Which layers go to which stage (pipegpt.model.partition, torch-free), and the Stage that runs one microbatch's
forward and backward, whole or piece by piece. The runtime (pipegpt.stages.runtime) is imported by its module's
name: it loads comm, the Stage does not."""
from pipegpt.model.partition import partition_layers
from .stage import Stage

__all__ = ["Stage", "partition_layers"]
