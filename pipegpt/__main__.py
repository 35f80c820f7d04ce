"""`python -m pipegpt` is the `pipegpt` command."""
from pipegpt.cli import main

main(prog_name="pipegpt")
