"""A training job: the driver (check, the plan, the loop), the worker (the RPC actor), and what the loop
uses: optimizer, checkpoints, metrics, the stall watchdog, rehearsed faults, profiling, device placement.
Nothing is re-exported here: import the submodules."""
