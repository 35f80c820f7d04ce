"""The model side: the GPT (gpt.py), the input/weight split of backward (split_backward.py) and its
training FLOPs per token (flops.py, torch-free, shared by the planner and the run's metrics).
Nothing is re-exported here, so importing flops.py loads no torch: import the submodules."""
