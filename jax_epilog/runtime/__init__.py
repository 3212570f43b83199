"""The runtime: what the package finds on this machine and how it talks to the C++ handler.

- `settings`: every `JAX_EPILOG_*` environment setting, parsed here and nowhere else;
- `library`: loading `libjax_epilog_ffi.so` (and the cuBLASLt it links), its setters, and
  cuBLASLt's answer to "is there a kernel for this problem?";
- `targets`: the XLA FFI targets, the attributes each decodes, their registration;
- `context`: the per-trace state, one `Context` (what planning reads, and the switches that
  change how a program is traced), and the one place it is held for a block.

Imports nothing else of jax_epilog; everything else may import it.
"""
