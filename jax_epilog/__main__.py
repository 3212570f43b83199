"""`python -m jax_epilog` runs the demonstration (see `jax_epilog.demo`)."""

from .demo import main

main()
