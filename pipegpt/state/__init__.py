"""Where a run's state is kept: layout-free checkpoints on disk (checkpoint), their copies in shared memory
(snapshot), the random streams a rank saves and restores (rng). Import the submodules."""
