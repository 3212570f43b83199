"""A float64 NumPy model of SPEC §1, written independently of `jax_epilog.reference`.

Tests check both the JAX reference (what the CPU runs) and the GPU kernel against this model,
so a mistake shared by the two JAX paths cannot pass unnoticed. It speaks the public API's
shapes (leading dims, 2-D shared b), not the kernel's normalised ones.
"""

from __future__ import annotations

import math

import numpy as np

_C = math.sqrt(2.0 / math.pi)


def gelu(z):
    return 0.5 * z * (1.0 + np.tanh(_C * (z + 0.044715 * z**3)))


def gelu_grad(z):
    t = np.tanh(_C * (z + 0.044715 * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t**2) * _C * (1.0 + 3 * 0.044715 * z**2)


def pack_bits(positive):
    """(..., M, N) bool -> (..., M, 16*ceil(N/128)) uint8, bit j%8 of byte j//8, LSB first."""
    *lead, m, n = positive.shape
    nbytes = 16 * ((n + 127) // 128)
    out = np.zeros((*lead, m, nbytes), np.uint8)
    for j in range(n):
        out[..., j // 8] |= (positive[..., j].astype(np.uint8) << (j % 8))
    return out


def unpack_bits(mask, n):
    out = np.zeros((*mask.shape[:-1], n), bool)
    for j in range(n):
        out[..., j] = (mask[..., j // 8] >> (j % 8)) & 1
    return out


def matmul(a, b, *, epilog="DEFAULT", bias=None, relu_aux=None, gelu_aux=None,
           transpose_a=False, transpose_b=False, c=None, alpha=1.0, beta=0.0):
    """Returns (y, aux_dict) in float64 (masks as uint8).

    With `c` (SPEC §6) the epilog runs on alpha · a@b + beta · c (the bias added after);
    the operand sums of BGRADA / BGRADB are a's and b's, unscaled."""
    name = epilog.upper() if isinstance(epilog, str) else epilog.name
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    op_a = np.swapaxes(a, -1, -2) if transpose_a else a
    op_b = np.swapaxes(b, -1, -2) if transpose_b else b
    p = np.matmul(op_a, op_b)
    if c is not None:
        p = float(alpha) * p + float(beta) * np.asarray(c, np.float64)
    n = p.shape[-1]
    z = p + np.asarray(bias, np.float64)[..., None, :] if bias is not None else p
    aux = {}
    if name in ("DEFAULT", "BIAS"):
        y = z
    elif name in ("RELU", "RELU_BIAS", "RELU_AUX", "RELU_AUX_BIAS"):
        # As cuBLASLt does it (measured): NaN passes through, the bit means "not negative".
        y = np.where((z > 0) | np.isnan(z), z, 0.0)
        if "AUX" in name:
            aux["relu_aux"] = pack_bits(~(z < 0))
    elif name in ("GELU", "GELU_BIAS", "GELU_AUX", "GELU_AUX_BIAS"):
        y = gelu(z)
        if "AUX" in name:
            cols = 8 * ((n + 7) // 8)
            pad = np.zeros((*z.shape[:-1], cols), np.float64)
            pad[..., :n] = z
            aux["gelu_aux"] = pad
    elif name in ("DRELU", "DRELU_BGRAD"):
        y = np.where(unpack_bits(np.asarray(relu_aux), n), p, 0.0)
    elif name in ("DGELU", "DGELU_BGRAD"):
        y = p * gelu_grad(np.asarray(gelu_aux, np.float64)[..., :n])
    elif name in ("BGRADA", "BGRADB"):
        y = p
    else:
        raise ValueError(name)
    if name.endswith("_BGRAD"):
        key = "drelu_bgrad" if name.startswith("DRELU") else "dgelu_bgrad"
        # Sum over M; with a shared 2-D b, over the leading dims too.
        axes = tuple(range(y.ndim - 1)) if b.ndim == 2 else (y.ndim - 2,)
        aux[key] = y.sum(axis=axes)
    if name == "BGRADA":
        aux["bgrada"] = op_a.sum(axis=-1)
    if name == "BGRADB":
        aux["bgradb"] = op_b.sum(axis=-2)
    return y, aux
