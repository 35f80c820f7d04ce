"""Inference where the model lives: the inference role on a rank's engine (worker.py), generation's decode loop
with a KV cache per stage and prompt group (generation.py), the token choice every sampler shares (sampling.py),
and the driver that starts workers in a layout and loads a checkpoint into them (job.py)."""
