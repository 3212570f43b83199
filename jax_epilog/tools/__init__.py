"""The command lines and what only they use: `demo` (`python -m jax_epilog`, its arguments in
`demo_cli`), `tune` (`python -m jax_epilog.tune`: measures and writes decision tables, with
`timing` and the benchmark `grid`), `explain` (`jax_epilog.explain` and
`python -m jax_epilog.explanation`), and `command_line` (parsing shared by the two).

May import everything below it; nothing in the package imports it but the public entry
points (`jax_epilog.tune`, `jax_epilog.explanation`, `jax_epilog.explain`, `__main__`).
"""
