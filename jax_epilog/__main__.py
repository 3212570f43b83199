"""`python -m jax_epilog` runs the demonstration (see `jax_epilog.demo`).

The command line is parsed here, before the demo is imported, so `--help` works without the
demo's extra dependencies; the demo itself says what to install when they are missing.
"""

from __future__ import annotations

import sys

from jax_epilog.tools.demo_cli import parse_args


def main() -> None:
    args = parse_args()
    try:
        from jax_epilog.tools import demo
    except ImportError as error:
        sys.exit(f"python -m jax_epilog: {error}")
    demo.run(args)


if __name__ == "__main__":
    main()
