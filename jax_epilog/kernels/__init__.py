"""Our own GPU kernels, in Pallas, where a measurement showed that neither cuBLASLt nor XLA
gets there:

- `weight_only`: the weight-only GEMM of FP8-stored weights over few rows (decoding).

Imports only JAX.
"""
