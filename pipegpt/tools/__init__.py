"""Commands around a checkpoint: convert (Hugging Face GPT-2), sample, hellaswag.
Nothing is re-exported here: import the submodules."""
