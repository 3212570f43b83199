"""`python -m jax_epilog.tune`: measure cuBLASLt against XLA for the GEMMs and layer stacks of a
program on this GPU and write the decision table that `backend="auto"` reads (implemented in
`jax_epilog.tools.tune`; `--help` says how)."""

import sys

from jax_epilog.tools.measurement import problems_of, stacks_of
from jax_epilog.tools.tune import main, tune

__all__ = ["main", "problems_of", "stacks_of", "tune"]

if __name__ == "__main__":
    sys.exit(main())
