"""`python -m jax_epilog.explanation MODULE:FUNCTION ARGS...` prints how each stack and GEMM of a
program runs on CUDA and why (implemented in `jax_epilog.tools.explain`)."""

import sys

from jax_epilog.tools.explain import Explanation, explain, explanation, main

__all__ = ["Explanation", "explain", "explanation", "main"]

if __name__ == "__main__":
    sys.exit(main())
