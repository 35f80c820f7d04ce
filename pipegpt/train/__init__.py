"""A training job: the driver (check, the plan, the loop), the worker (the training role on a rank's engine),
the optimizer, gradient synchronisation, the run directory, restarts and `pipegpt run`'s launch.
Nothing is re-exported here: import the submodules."""
