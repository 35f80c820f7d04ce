"""Training data: tokenizers, token files and the built-in corpus (torch-free), the per-rank loader, and
`pipegpt prepare`. Nothing is re-exported here: import the submodules."""
