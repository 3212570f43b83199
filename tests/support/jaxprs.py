"""Reading what a function traces to: every equation of its jaxpr, nested ones included
(custom_vjp, pjit, scan and cond bodies), for tests that check which primitives a call binds."""

from __future__ import annotations

from collections.abc import Iterator

import jax


def equations(closed_jaxpr) -> Iterator:
    """Every equation of `closed_jaxpr` (a `jax.make_jaxpr` result or a `Jaxpr`), depth first,
    the equations of the jaxprs in its equations' parameters included."""
    jaxpr = getattr(closed_jaxpr, "jaxpr", closed_jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
                    yield from equations(sub)


def traced_equations(fn, *args) -> list:
    """`equations` of `jax.make_jaxpr(fn)(*args)`."""
    return list(equations(jax.make_jaxpr(fn)(*args)))
