"""PURE PYTHON (no torch): what a layout costs, before any run: device figures (devices), each layer's time and
each message's and collective's (cost), the bytes a rank holds (memory, activations), the split of layers that
balances the ranks (balance) and a candidate's per-stage costs (stage_costs). The planner (pipegpt.planner)
searches with them; the run's own plan and elastic restarts ask them too. Import the submodules."""
