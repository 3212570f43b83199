"""`jax_epilog.matmul`: the public op (SPEC §1), its argument checks and its gradient.

The user's arrays are checked here, once, with errors that name the argument, and reshaped
(never copied) into the kernel's rank-3 form: a 2-D `b` shared by every leading index of `a`
folds those indices into M, so the whole call is one GEMM; otherwise leading dims become one
strided batch. What each epilog reads and writes comes from `epilogs.TABLE`.

The forward epilogs are differentiable through one `jax.custom_vjp` (`_forward`). Its forward
keeps what the backward needs: ReLU's output (its derivative is y > 0, 0 at 0, as
`jax.nn.relu`'s), or the mask where the call returns it (RELU_AUX*: 1 at 0), GELU's
pre-activation. Its backward is the layers' (`activation_gradient`, `data_gradient`,
`weight_gradient`): two more `matmul` calls in the operands' dtype, the bias gradient from the
weight-gradient GEMM (BGRADB, or BGRADA for a transposed b). Where every GEMM of the step runs
XLA's way on this GPU and nothing needs the custom VJP (no aux output, alpha and beta Python
numbers), JAX differentiates the plain expression instead (`_step_runs_xla`): XLA compiles it as
a user's own. `reference_matmul` is the same function running the reference directly; plain
JAX differentiates it, which is what the custom VJP is tested against.
"""

from __future__ import annotations

import difflib
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import cuda_library, plan
from . import manual_axes
from .epilogs import (ACTIVATIONS, ARRAYS, DEFAULT_FP8_RESULT, FP8_DTYPES, FP8_RESULT_DTYPES,
                      Epilog, array_dtype, as_epilog, dim_sizes, is_fp8, result_names,
                      scale_names)
from .primitive import BACKENDS, Params, epilog_matmul_p
from .reference import epilog_matmul as reference_kernel

SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
#: Operand dtypes: SUPPORTED_DTYPES, and the FP8 formats with `quantization_scales` (SPEC §5).
OPERAND_DTYPES = SUPPORTED_DTYPES + tuple(jnp.dtype(d) for d in FP8_DTYPES)

#: Pass as `jax.export.export(..., disabled_checks=EXPORT_SAFETY_CHECKS)` when exporting for
#: CUDA: the exported module calls our custom calls, which JAX does not know to be stable.
EXPORT_SAFETY_CHECKS = tuple(jax.export.DisabledSafetyCheck.custom_call(target) for target in
                             (cuda_library.TARGET_NAME, cuda_library.TARGET_NAME_C))


# --- argument checks --------------------------------------------------------------------------

def _raw_dtype(x) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    return jnp.dtype(np.asarray(x).dtype if dtype is None else dtype)


def _dtype_of(name: str, x) -> np.dtype:
    dtype = _raw_dtype(x)
    if dtype not in OPERAND_DTYPES:
        extra = ""
        if isinstance(x, (list, tuple)) and x is not None:
            extra = (f" (a Python {type(x).__name__} becomes {dtype} in NumPy; pass "
                     f"jnp.asarray({name}, dtype=jnp.float32), or bfloat16 / float16)")
        elif dtype == jnp.float64:
            extra = " (float64 is not supported by cuBLASLt's epilogs; cast to float32)"
        raise TypeError(f"{name}: expected dtype float16, bfloat16 or float32, got {dtype}{extra}"
                        " (or FP8: float8_e4m3fn / float8_e5m2 with quantization_scales)")
    return dtype


def _as_operand(name: str, x):
    dtype = _dtype_of(name, x)
    x = jnp.asarray(x, dtype=dtype)
    if x.ndim < 2:
        raise ValueError(f"{name}: expected an array of rank >= 2, got shape {x.shape}")
    return x


def allow_tf32_for(precision, dtype) -> bool:
    """Whether a float32 GEMM may use TF32: DEFAULT and HIGH may, HIGHEST may not (SPEC §1)."""
    if jnp.dtype(dtype) != jnp.float32:
        return False
    if precision is None:
        precision = jax.config.jax_default_matmul_precision
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2 or precision[0] != precision[1]:
            raise ValueError(f"precision: expected one precision for both operands, got {precision}")
        precision = precision[0]
    if precision is None:
        return True
    if isinstance(precision, str):
        if precision.lower() in ("float32", "highest", "fastest_float32"):
            return precision.lower() == "fastest_float32"
        try:
            precision = jax.lax.Precision(precision)
        except ValueError:
            raise ValueError(f"precision: unknown value {precision!r}; expected None, a "
                             "jax.lax.Precision or its name") from None
    if not isinstance(precision, jax.lax.Precision):
        raise TypeError(f"precision: expected None or jax.lax.Precision, got {precision!r}")
    return precision != jax.lax.Precision.HIGHEST


def _check_epilog_inputs(epilog: Epilog, epilog_inputs) -> dict[str, Any]:
    if epilog_inputs is None:
        epilog_inputs = {}
    if not isinstance(epilog_inputs, Mapping):
        raise TypeError(f"epilog_inputs: expected a dict, got {type(epilog_inputs).__name__}")
    given, needed = set(epilog_inputs), set(epilog.input_names)
    missing, stray = sorted(needed - given), sorted(given - needed, key=str)
    if stray:
        takes = sorted(needed) if needed else "no inputs"
        known = sorted({name for e in Epilog for name in e.input_names})
        hints = [f"{close[0]!r} for {key!r}" for key in stray if key not in known
                 for close in [difflib.get_close_matches(str(key), known, n=1)] if close]
        raise ValueError(
            f"epilog_inputs: epilog {epilog.name} takes {takes}, got unexpected {stray}"
            + (f" (did you mean {', '.join(hints)}?)" if hints else "")
            + (f"; missing {missing}" if missing else ""))
    if missing:
        raise ValueError(f"epilog_inputs: epilog {epilog.name} needs {sorted(needed)}, "
                         f"missing {missing}")
    return dict(epilog_inputs)


def _check_input(name: str, x, *, dtype, shapes: list[tuple[int, ...]], n: int):
    label = f"epilog_inputs['{name}']"
    what = f"{ARRAYS[name].what} for N={n}"
    got = _raw_dtype(x)
    if got != dtype:
        hint = ("; a boolean mask is packed into cuBLASLt's layout by "
                "jax_epilog.pack_relu_mask(mask)") if name == "relu_aux" and got == bool else ""
        raise TypeError(f"{label}: expected dtype {jnp.dtype(dtype)} ({what}), got {got}{hint}")
    x = jnp.asarray(x)
    if tuple(x.shape) not in shapes:
        expected = " or ".join(str(s) for s in dict.fromkeys(shapes))
        raise ValueError(f"{label}: expected shape {expected} ({what}), got {tuple(x.shape)}")
    return x


def _user_shapes(name: str, lead: tuple, m: int, n: int) -> list[tuple[int, ...]]:
    """The shapes `epilog_inputs[name]` may have: the kernel's, with `lead` for its batch."""
    sizes = dim_sizes(1, m, n)
    dims = ARRAYS[name].dims
    rest = tuple(sizes[d] for d in dims[1:])
    return [rest, (*lead, *rest)] if dims[0] == "bias_batch" else [(*lead, *rest)]


class _Call(NamedTuple):
    """A checked call, in the kernel's rank-3 form, and how to shape its results back."""

    a: Any
    b: Any
    inputs: tuple
    params: Params
    lead: tuple[int, ...]
    m: int
    n: int
    b_shared: bool


_E5M2 = jnp.dtype(jnp.float8_e5m2)


def _check_operand_dtypes(a, b) -> bool:
    """Whether the call is an FP8 one; refuses mixed and e5m2 x e5m2 operands."""
    fp8_a, fp8_b = is_fp8(a.dtype), is_fp8(b.dtype)
    if fp8_a != fp8_b:
        name, x, other, o = ("a", a, "b", b) if fp8_a else ("b", b, "a", a)
        raise TypeError(f"{name}: got {x.dtype} but {other} is {o.dtype}; FP8 operands must both "
                        f"be FP8 (float8_e4m3fn or float8_e5m2) or neither: quantize {other} too "
                        "(SPEC §5)")
    if not fp8_a and a.dtype != b.dtype:
        raise TypeError(f"b: dtype {b.dtype} differs from a's {a.dtype}; they must be equal")
    if fp8_a and a.dtype == _E5M2 and b.dtype == _E5M2:
        raise TypeError("b: a and b are both float8_e5m2, and cuBLASLt has no e5m2 x e5m2 GEMM; "
                        "make one of them float8_e4m3fn (e.g. e4m3 activations and weights, e5m2 "
                        "gradients)")
    return fp8_a


def _result_dtype(fp8: bool, operand_dtype, preferred_element_type) -> np.dtype:
    if not fp8:
        if preferred_element_type is not None and \
                _as_dtype(preferred_element_type) != operand_dtype:
            raise TypeError(f"preferred_element_type: with {operand_dtype} operands the result "
                            f"has their dtype; got {preferred_element_type!r} (other result "
                            "types need FP8 operands)")
        return jnp.dtype(operand_dtype)
    if preferred_element_type is None:
        return jnp.dtype(DEFAULT_FP8_RESULT)
    out = _as_dtype(preferred_element_type)
    if out.name not in FP8_RESULT_DTYPES:
        raise TypeError(f"preferred_element_type: with FP8 operands expected one of "
                        f"{', '.join(FP8_RESULT_DTYPES)}, got {out.name}")
    return out


def _as_dtype(x) -> np.dtype:
    try:
        return jnp.dtype(x)
    except TypeError:
        raise TypeError(f"preferred_element_type: expected a dtype (e.g. jnp.bfloat16 or "
                        f"jnp.float8_e4m3fn), got {x!r}") from None


def _check_scale(key: str, x, label: Optional[str] = None):
    label = label or f"quantization_scales[{key!r}]"
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{label}: expected a float32 scalar or a Python float, got {x!r}")
    if isinstance(x, (int, float)) and not isinstance(x, np.ndarray):  # np.float64 is a float
        return jnp.asarray(x, jnp.float32)
    dtype = getattr(x, "dtype", None)
    shape = getattr(x, "shape", None)
    if dtype is None or shape is None:
        raise TypeError(f"{label}: expected a float32 scalar or a Python float, got "
                        f"{type(x).__name__} {x!r}")
    if jnp.dtype(dtype) != jnp.float32:
        raise TypeError(f"{label}: expected dtype float32 (a scalar scale), got {jnp.dtype(dtype)}")
    if tuple(shape) != ():
        raise ValueError(f"{label}: expected a scalar (shape ()), got shape {tuple(shape)}")
    return jnp.asarray(x)


def _check_scales(fp8: bool, out, quantization_scales, result_amax) -> tuple:
    """The scale operands (a's, b's, d's for an FP8 result) as float32 0-d arrays."""
    if not isinstance(result_amax, (bool, np.bool_)):
        raise TypeError(f"result_amax: expected a bool, got {result_amax!r}")
    if not fp8:
        if quantization_scales is not None:
            raise TypeError("quantization_scales: only for FP8 operands (float8_e4m3fn / "
                            "float8_e5m2); a and b are not FP8")
        if result_amax:
            raise TypeError("result_amax: only for FP8 operands (float8_e4m3fn / float8_e5m2); "
                            "a and b are not FP8 (take jnp.max(jnp.abs(y)) instead)")
        return ()
    if quantization_scales is None:
        raise TypeError("quantization_scales: FP8 operands need their scales, e.g. "
                        "quantization_scales={'a': sa, 'b': sb} (float32 scalars: a stands for "
                        "sa * a)" + (", and 'd' for an FP8 result" if is_fp8(out) else ""))
    if not isinstance(quantization_scales, Mapping):
        raise TypeError(f"quantization_scales: expected a dict, got "
                        f"{type(quantization_scales).__name__}")
    keys = ("a", "b", "d") if is_fp8(out) else ("a", "b")
    stray = sorted((k for k in quantization_scales if k not in keys), key=str)
    if "d" in stray:
        raise ValueError(f"quantization_scales['d']: only for an FP8 result "
                         f"(preferred_element_type float8_e4m3fn or float8_e5m2); the result "
                         f"is {out.name}")
    if stray:
        raise ValueError(f"quantization_scales: unexpected keys {stray}; expected 'a', 'b'"
                         + (" and 'd'" if is_fp8(out) else " ('d' only for an FP8 result)"))
    missing = [k for k in ("a", "b") if k not in quantization_scales]
    if missing:
        raise ValueError(f"quantization_scales: missing {missing}; FP8 operands need 'a' and 'b'")
    scales = [_check_scale(k, quantization_scales[k]) for k in ("a", "b")]
    if is_fp8(out):
        d = quantization_scales.get("d", None)
        scales.append(jnp.ones((), jnp.float32) if d is None else _check_scale("d", d))
    assert len(scales) == len(scale_names(FP8_DTYPES[0], out))
    return tuple(scales)


def _check_fast_accumulation(fast_accumulation, operand_dtype) -> bool:
    """`fast_accumulation` as a bool; only FP8 operands may ask for it."""
    if not isinstance(fast_accumulation, (bool, np.bool_)):
        raise TypeError(f"fast_accumulation: expected a bool, got {fast_accumulation!r}")
    if fast_accumulation and not is_fp8(operand_dtype):
        hint = ("; for float32, precision= chooses TF32 (DEFAULT / HIGH) or full float32 "
                "(HIGHEST)" if operand_dtype == jnp.float32 else
                "; 16-bit operands always accumulate in float32")
        raise ValueError(f"fast_accumulation: applies to FP8 operands only (float8_e4m3fn / "
                         f"float8_e5m2); a and b are {operand_dtype}{hint}")
    return bool(fast_accumulation)


def _check_c(c, alpha, beta, out, lead, m: int, n: int):
    """(c, alpha, beta) as checked operands, or () for a call without C (SPEC §6)."""
    if c is None:
        if beta is not None:
            raise TypeError("beta: only with c (the matrix added as beta · c); pass c too, "
                            "e.g. matmul(a, b, c, beta=1.0)")
        if alpha is not None:
            raise TypeError("alpha: only with c (the matrix added as beta · c); pass c and "
                            "beta too, or scale a or b instead")
        return ()
    if beta is None:
        raise TypeError("beta: required when c is given (R = epilog(alpha · a@b + beta · c)); "
                        "e.g. beta=1.0 for a residual add")
    if is_fp8(out):
        raise TypeError(f"c: an FP8 result ({out.name}) with c is not supported; ask for a "
                        "16/32-bit preferred_element_type (c then has that dtype)")
    want = array_dtype("c", out)
    got = _raw_dtype(c)
    if got != want:
        raise TypeError(f"c: expected dtype {want} (y's dtype), got {got}")
    c = jnp.asarray(c)
    if tuple(c.shape) != (*lead, m, n):
        hint = ("; a row of N added to every row is a bias: epilog='bias' (or 'relu_bias', ...) "
                "with epilog_inputs={'bias': ...}" if tuple(c.shape) == (n,) else "")
        raise ValueError(f"c: expected shape {(*lead, m, n)} (y's shape), got "
                         f"{tuple(c.shape)}{hint}")
    alpha = jnp.ones((), jnp.float32) if alpha is None else _check_scale("alpha", alpha, "alpha")
    return (c, alpha, _check_scale("beta", beta, "beta"))


def _prepare(a, b, epilog, epilog_inputs, transpose_a, transpose_b, precision,
             backend="auto", quantization_scales=None, preferred_element_type=None,
             result_amax=False, c=None, alpha=None, beta=None,
             fast_accumulation=False) -> _Call:
    epilog = as_epilog(epilog)
    a = _as_operand("a", a)
    b = _as_operand("b", b)
    fp8 = _check_operand_dtypes(a, b)
    out = _result_dtype(fp8, a.dtype, preferred_element_type)
    scales = _check_scales(fp8, out, quantization_scales, result_amax)
    fast_accumulation = _check_fast_accumulation(fast_accumulation, a.dtype)
    for name, flag in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    inputs = _check_epilog_inputs(epilog, epilog_inputs)

    lead = tuple(a.shape[:-2])
    m, k = (a.shape[-1], a.shape[-2]) if transpose_a else (a.shape[-2], a.shape[-1])
    kb, n = (b.shape[-1], b.shape[-2]) if transpose_b else (b.shape[-2], b.shape[-1])
    if kb != k:
        swapped = b.shape[-2] if transpose_b else b.shape[-1]
        hint = (f"; b looks stored {'(K, N)' if transpose_b else '(N, K)'}: pass transpose_b="
                f"{not transpose_b}" + (" (FP8 kernels read b as (N, K) with transpose_b=True)"
                                        if fp8 and not transpose_b else "")
                if swapped == k else "")
        raise ValueError(f"b: contraction size K={kb} (b shape {b.shape}, transpose_b="
                         f"{transpose_b}) does not match a's K={k} (a shape {a.shape}, "
                         f"transpose_a={transpose_a}){hint}")
    b_shared = b.ndim == 2
    if not b_shared and tuple(b.shape[:-2]) != lead:
        raise ValueError(f"b: leading dims {tuple(b.shape[:-2])} must equal a's leading dims "
                         f"{lead} (or b must be 2-D to be shared)")
    c_operands = _check_c(c, alpha, beta, out, lead, m, n)
    checked = {name: _check_input(name, inputs[name], dtype=array_dtype(name, out),
                                  shapes=_user_shapes(name, lead, m, n), n=n)
               for name in epilog.input_names}

    batch = math.prod(lead)
    bias_per_batch = "bias" in checked and checked["bias"].ndim > 1
    # A shared b: one GEMM over all rows, the leading dims folded into M. Otherwise (a's rows
    # are not contiguous, or the bias differs per batch) one strided-batched GEMM.
    folded = b_shared and not transpose_a and not bias_per_batch
    kernel_batch, kernel_m = (1, batch * m) if folded else (batch, m)
    a3 = a.reshape(kernel_batch, *((kernel_m, k) if folded else a.shape[-2:]))
    b3 = b.reshape(1 if b_shared else batch, *b.shape[-2:])
    # Explicit sizes, not -1: any of them may be 0 (an empty problem is valid).
    kernel_inputs = tuple(
        checked[name].reshape(batch if bias_per_batch else 1, n) if name == "bias"
        else checked[name].reshape(kernel_batch, kernel_m, checked[name].shape[-1])
        for name in epilog.input_names) + scales
    if c_operands:  # c folds like y
        c3 = c_operands[0].reshape(kernel_batch, kernel_m, n)
        kernel_inputs += (c3, *c_operands[1:])
    params = Params(int(epilog), bool(transpose_a), bool(transpose_b),
                    allow_tf32_for(precision, a.dtype), backend,
                    result_dtype=out.name if fp8 else None, result_amax=bool(result_amax),
                    has_c=bool(c_operands), fast_accumulation=fast_accumulation)
    return _Call(a3, b3, kernel_inputs, params, lead, m, n, b_shared)


def _finish(call: _Call, outputs):
    """Shape the kernel's outputs back to the user's leading dims."""
    epilog = Epilog(call.params.epilog)
    y, *rest = outputs
    aux = {}
    for name, x in zip(result_names(epilog, call.params.result_amax)[1:], rest):
        sums = ARRAYS[name].sums
        if ARRAYS[name].dims == ():  # result_amax: one scalar for the whole call
            pass
        elif not sums:  # an aux array (batch, M, ·)
            x = x.reshape(*call.lead, call.m, x.shape[-1])
        elif sums == "a":  # (batch, M)
            x = x.reshape(*call.lead, call.m)
        elif not call.b_shared:  # (batch, N)
            x = x.reshape(*call.lead, call.n)
        elif sums == "b":  # a shared b: every batch's row is the same sum
            x = x[0] if x.shape[0] else _sum_over_k(call, x.dtype)
        else:  # a shared b's bias: its gradient sums over every leading index
            x = x.sum(axis=0, dtype=jnp.float32).astype(x.dtype) if x.shape[0] != 1 else x[0]
        aux[name] = x
    y = y.reshape(*call.lead, call.m, call.n)
    return (y, aux) if aux else y


def _sum_over_k(call: _Call, dtype):
    """b summed over K (times its FP8 scale), for BGRADB of an empty batch (no kernel row to
    read it from)."""
    b2 = call.b[0]
    total = jnp.sum(b2.astype(jnp.float32), axis=1 if call.params.transpose_b else 0)
    if is_fp8(b2.dtype):  # the scales follow the epilog's inputs: a's, then b's
        total = total * call.inputs[len(Epilog(call.params.epilog).input_names) + 1]
    return total.astype(dtype)


# --- the kernel call and its gradient -----------------------------------------------------

def _kernel(params: Params, a, b, *inputs):
    """The primitive's outputs, typed as varying over the operands' manual axes."""
    outputs = epilog_matmul_p.bind(a, b, *inputs, **params._asdict())
    axes = manual_axes.varying_axes((a, b, *inputs))  # which the primitive's type leaves out
    return tuple(manual_axes.vary(o, axes) for o in outputs)


class _Scalars(NamedTuple):
    """alpha and beta where the caller passed Python numbers (None where they are arrays):
    known at trace time, they have nothing to differentiate and cost the backward nothing."""

    alpha: Optional[float]
    beta: Optional[float]


def _python_number(x, default=None) -> Optional[float]:
    if x is None:
        return default
    is_number = isinstance(x, (int, float)) and not isinstance(x, (bool, np.bool_, np.ndarray))
    return float(x) if is_number else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _forward(params: Params, scalars: _Scalars, a, b, *inputs):
    return _kernel(params, a, b, *inputs)


def _keeps_output(epilog: Epilog) -> bool:
    """Whether the backward reads ReLU's derivative off the output (y > 0), as XLA's own
    gradient of `relu(x @ w + b)` does: the caller holds y anyway, so no mask is written. Where
    the call returns the mask (RELU_AUX*), the backward uses it."""
    return epilog.activation == "relu" and not epilog.aux_output


def _forward_epilog(epilog: Epilog) -> Epilog:
    """The epilog the training forward runs: with the residual the backward needs (the
    pre-activation for GELU), or as called where ReLU's output is the residual."""
    return epilog if _keeps_output(epilog) or not epilog.activation else epilog.with_aux


def _forward_fwd(params: Params, scalars: _Scalars, a, b, *inputs):
    epilog = Epilog(params.epilog)
    outputs = _kernel(params._replace(epilog=int(_forward_epilog(epilog))), a, b, *inputs)
    residual = outputs[0] if _keeps_output(epilog) else outputs[1] if epilog.activation else None
    visible = outputs if epilog.aux_output or not epilog.activation else outputs[:1]
    bias = inputs[0] if epilog.has_bias else None
    c_args = tuple(inputs[-3:]) if params.has_c else None  # (c, alpha, beta)
    return visible, (a, b, residual, bias, c_args)


# The backward GEMMs, shared with the layers (`layers._stack_bwd`): each is a `matmul` call, so
# `backend="auto"` picks cuBLASLt's epilog or XLA's GEMM per problem, as for any call, and 16-bit
# operands stay 16-bit (float32 accumulation inside the GEMM, as XLA's own transpose of a dot).

def activation_gradient(dy, residual, activation: Optional[str], extra=None):
    """dZ from dY = d act(Z), elementwise (the mask for ReLU, gelu'(Z) for GELU), in dY's
    dtype, computed in float32 in one pass; `extra` (a cotangent of Z itself) adds on."""
    if activation is None and extra is None:
        return dy
    dz = dy.astype(jnp.float32)
    if activation is not None:
        dz = ACTIVATIONS[activation].derivative(dz, residual, dy.shape[-1])
    if extra is not None:
        dz = dz + extra.astype(jnp.float32)
    return dz.astype(dy.dtype)


def weight_gradient(h, dz, *, bias_gradient: bool, precision, backend: str,
                    transpose_h: bool = False, transpose_result: bool = False):
    """(dW, dbias or None) for Z = op(h) @ W: dW = op(h)ᵀ dZ (K, N), or with `transpose_result`
    dWᵀ = dZᵀ op(h) (N, K) for a W stored transposed. `h` is (R, K), or (K, R) with
    `transpose_h`. The bias gradient, dZ summed over the rows, comes from the same GEMM
    (BGRADB, or BGRADA for the transposed result: the summed operand is then A)."""
    if transpose_result:
        epilog, name = Epilog.BGRADA, "bgrada"
        out = matmul(dz, h, transpose_a=True, transpose_b=transpose_h, precision=precision,
                     backend=backend, epilog=epilog if bias_gradient else Epilog.DEFAULT)
    else:
        epilog, name = Epilog.BGRADB, "bgradb"
        out = matmul(h, dz, transpose_a=not transpose_h, precision=precision, backend=backend,
                     epilog=epilog if bias_gradient else Epilog.DEFAULT)
    return (out[0], out[1][name]) if bias_gradient else (out, None)


def data_gradient(dz, w, *, precision, backend: str, transpose_w: bool = False,
                  activation: Optional[str] = None, has_bias: bool = False, residual=None):
    """(dX, dbias or None) for Z = X @ op(W): dX = dZ op(W)ᵀ. With the `activation` of the
    layer below (its `residual` kept by the forward), the same GEMM applies its derivative and,
    where that layer `has_bias`, reduces its bias gradient (DRELU_BGRAD / DGELU_BGRAD, DRELU /
    DGELU without a bias)."""
    if activation is None:
        return matmul(dz, w, transpose_b=not transpose_w, precision=precision,
                      backend=backend), None
    epilog = Epilog.find_derivative(activation, bias_gradient=has_bias)
    out = matmul(dz, w, transpose_b=not transpose_w, epilog=epilog, precision=precision,
                 backend=backend, epilog_inputs={epilog.aux_input: residual})
    return (out[0], out[1][epilog.reduction_output]) if has_bias else (out, None)


def _forward_bwd(params: Params, scalars: _Scalars, saved, cotangents):
    a, b, residual, bias, c_args = saved
    epilog = Epilog(params.epilog)
    # The pre-activation, when it was an output too, has a cotangent of its own.
    extra = cotangents[1][..., :cotangents[0].shape[-1]] if (
        epilog.activation == "gelu" and epilog.aux_output) else None
    if _keeps_output(epilog):  # jax.nn.relu's derivative: 0 at 0
        dz = jnp.where(residual > 0, cotangents[0], jnp.zeros_like(cotangents[0]))
    else:
        dz = activation_gradient(cotangents[0], residual, epilog.activation, extra)
    gemm = dict(precision=jax.lax.Precision.DEFAULT if params.allow_tf32 else
                jax.lax.Precision.HIGHEST, backend=params.backend)
    ta, tb = params.transpose_a, params.transpose_b
    batch = dz.shape[0]
    # The bias gradient comes from the weight-gradient GEMM where that GEMM sums the same rows:
    # a bias shared by the batch with a shared b (one GEMM over every row), or a batched b.
    shared_b = b.shape[0] == 1
    fused_dbias = bias is not None and (not shared_b or bias.shape[0] == 1)

    # dA = dZ op(b)ᵀ, in a's stored layout: (batch, M, K), or (batch, K, M) with transpose_a.
    if not ta:
        da, _ = data_gradient(dz, b[0] if shared_b else b, transpose_w=tb, **gemm)
    elif not shared_b:
        da = matmul(b, dz, transpose_a=tb, transpose_b=True, **gemm)
    elif batch == 1:  # dAᵀ = op(b) dZᵀ: one GEMM that writes a's layout
        da = matmul(b[0], dz[0], transpose_a=tb, transpose_b=True, **gemm)[None]
    else:  # a shared b under a batched, transposed a: XLA transposes the result
        da = jnp.swapaxes(data_gradient(dz, b[0], transpose_w=tb, **gemm)[0], 1, 2)

    # dB = op(a)ᵀ dZ, in b's stored layout: (·, K, N), or (·, N, K) with transpose_b.
    if shared_b:  # every row of every batch contributes: one GEMM over all of them
        if batch == 1:
            h, transpose_h = a[0], ta
        else:  # a batched, transposed a has no contiguous rows: XLA transposes it first
            rows = jnp.swapaxes(a, 1, 2) if ta else a
            h, transpose_h = rows.reshape(batch * rows.shape[1], rows.shape[2]), False
        # Explicit sizes, not -1: any of them may be 0.
        dz_rows = dz.reshape(batch * dz.shape[1], dz.shape[2])
        db, dbias = weight_gradient(h, dz_rows, bias_gradient=fused_dbias,
                                    transpose_h=transpose_h, transpose_result=tb, **gemm)
        db = db[None]
        dbias = None if dbias is None else dbias[None]
    else:
        db, dbias = weight_gradient(a, dz, bias_gradient=fused_dbias, transpose_h=ta,
                                    transpose_result=tb, **gemm)
        if dbias is not None and bias.shape[0] == 1:
            dbias = jnp.sum(dbias, axis=0, keepdims=True, dtype=jnp.float32).astype(bias.dtype)
    if bias is not None and dbias is None:  # a per-batch bias with a shared b
        dbias = jnp.sum(dz, axis=1, dtype=jnp.float32).astype(bias.dtype)

    grads = [da, db]
    if bias is not None:
        grads.append(dbias)
    if c_args is not None:  # Z = alpha · P + beta · C (+ bias): dP = alpha · dZ
        grads += _c_gradients(scalars, c_args, a, da, dz)
        alpha = c_args[1] if scalars.alpha is None else scalars.alpha
        if scalars.alpha != 1.0:
            grads[0], grads[1] = (_scaled(g, alpha) for g in grads[:2])
    return tuple(grads)


def _c_gradients(scalars: _Scalars, c_args, a, da, dz) -> list:
    """[dC, d alpha, d beta] for Z = alpha · P + beta · C (+ bias), `da` being dZ op(b)ᵀ in a's
    layout before the alpha scale: d alpha = sum(dZ ⊙ P) = sum(da ⊙ a), no extra product."""
    c, alpha, beta = c_args
    if scalars.beta == 1.0 and c.dtype == dz.dtype:
        dc = dz
    else:
        beta_value = beta if scalars.beta is None else scalars.beta
        dc = (dz.astype(jnp.float32) * beta_value).astype(c.dtype)  # one fused pass
    zero = jnp.zeros((), jnp.float32)
    dalpha = zero if scalars.alpha is not None else jnp.sum(
        da.astype(jnp.float32) * a.astype(jnp.float32))
    dbeta = zero if scalars.beta is not None else jnp.sum(
        dz.astype(jnp.float32) * c.astype(jnp.float32))
    return [dc, dalpha, dbeta]


def _scaled(g, alpha):
    return (g * jnp.asarray(alpha, jnp.float32)).astype(g.dtype)


_forward.defvjp(_forward_fwd, _forward_bwd)


def _step_runs_xla(call: _Call) -> bool:
    """Whether the plan runs the call's training step as the plain expression under JAX's
    autodiff (`plan.plan_matmul_step`: every GEMM of the step runs XLA's way on this CUDA GPU;
    XLA then compiles it as it compiles a user's own, the never-slower rule the layers follow
    per stack)."""
    p = call.params
    step = plan.plan_matmul_step(plan.context(), p, call.a.shape, call.b.shape, call.a.dtype,
                                 _forward_epilog(Epilog(p.epilog)))
    return step.choice == "plain"


def _users_expression(params: Params, a, b, *inputs):
    """The plain path of a call with a 2-D b, a bias of shape (N,) if any and no c, written as
    its user would write it: `op(a) @ op(b) + bias`, then the activation, on the caller's own
    operands. XLA then compiles exactly the user's program: the same call through
    `_reference`'s rank-3 form (a (1, M, K) product, a (1, N) bias, a weight gradient
    contracting two axes) ran 2-7% behind the user's GELU step on the H200."""
    if params.transpose_a:
        a = jnp.swapaxes(a, -1, -2)
    reduced = params.allow_tf32 or a.dtype != jnp.float32  # XLA's way, as `_reference`'s
    precision = jax.lax.Precision.DEFAULT if reduced else jax.lax.Precision.HIGHEST
    z = jnp.matmul(a, b.T if params.transpose_b else b, precision=precision,
                   preferred_element_type=a.dtype)
    epilog = Epilog(params.epilog)
    if epilog.has_bias:
        z = z + inputs[0].astype(z.dtype)
    return ACTIVATIONS[epilog.activation].plain(z) if epilog.activation else z


def _reference(params: Params, a, b, *inputs, exact: bool = True):
    """The call's outputs by the reference: exact, or in XLA's way (the plain expression, for
    JAX's own autodiff where `_step_runs_xla`)."""
    return reference_kernel(a, b, *inputs, epilog=params.epilog, exact=exact,
                            transpose_a=params.transpose_a, transpose_b=params.transpose_b,
                            allow_tf32=params.allow_tf32, result_dtype=params.result_dtype,
                            result_amax=params.result_amax, has_c=params.has_c,
                            fast_accumulation=params.fast_accumulation)


def matmul(a, b, c=None, *, alpha=None, beta=None, epilog=Epilog.DEFAULT,
           epilog_inputs: Optional[Mapping[str, Any]] = None,
           transpose_a: bool = False, transpose_b: bool = False, precision=None,
           backend: str = "auto", quantization_scales: Optional[Mapping[str, Any]] = None,
           preferred_element_type=None, result_amax: bool = False,
           fast_accumulation: bool = False):
    """`a @ b` with a cuBLASLt epilog fused into the same kernel (SPEC §1, §5, §6).

    Args:
      a: `(..., M, K)`, or `(..., K, M)` with `transpose_a`; float16, bfloat16 or float32, or
        FP8 (float8_e4m3fn / float8_e5m2, with `quantization_scales`).
      b: `(K, N)` shared by every leading index of `a`, or `(..., K, N)` with the same leading
        dims (`(…, N, K)` with `transpose_b`); same dtype as `a` (FP8: both FP8, not both e5m2).
      c: optional, y's shape `(..., M, N)` and dtype (with FP8 operands the 16/32-bit result's;
        an FP8 result with c is refused): the result is R = epilog(alpha · a@b + beta · c), the
        bias (if any) added after beta · c (SPEC §6, docs/c_alpha_beta.md).
      alpha, beta: with c only; beta is required, alpha defaults to 1. Python numbers or
        float32 0-d arrays (traced values work under `jit`; arrays are differentiable).
      epilog: an `Epilog`, its value, its name (e.g. ``"relu_aux_bias"``), or nvmath-python's
        `MatmulEpilog` member of that name.
      epilog_inputs: ``{"bias": (N,) | (..., N)}`` for the bias epilogs,
        ``{"relu_aux": mask}`` for DRELU*, ``{"gelu_aux": pre_activation}`` for DGELU*.
        Floating inputs have y's dtype (bfloat16 when y is FP8).
      transpose_a, transpose_b: read the operand transposed (no copy is made for 16/32-bit
        operands; FP8 kernels need (M, K) and (N, K) operands, which the CUDA lowering
        arranges by a transpose XLA fuses into the operand's producer).
      precision: for float32, `jax.lax.Precision.HIGHEST` is full float32; DEFAULT / HIGH may
        use TF32. Ignored for 16-bit and FP8 dtypes (accumulation is float32; for FP8 see
        `fast_accumulation`).
      backend: on CUDA, "cublaslt" runs the cuBLASLt kernel, "xla" XLA's own GEMM and fusions
        of the same computation, "auto" the faster of the two for this problem on this GPU, as
        measured (`jax_epilog.dispatch`; FP8 problems without a measurement run cuBLASLt).
        Other platforms always run the reference.
      quantization_scales: FP8 operands only, and required with them: ``{"a": sa, "b": sb}``
        (float32 0-d arrays or Python floats; traced values work under `jit`), plus ``"d": sd``
        (default 1) for an FP8 result. The product is P = (sa·a) @ (sb·b).
      preferred_element_type: FP8 operands only: y's dtype, float16, bfloat16 (the default),
        float32, float8_e4m3fn or float8_e5m2. An FP8 y is sd·R rounded and saturated to the
        format's largest finite value (NaN stays NaN).
      result_amax: FP8 operands only: also return ``aux["result_amax"]``, float32 max |R| taken
        before the d scale and the cast.
      fast_accumulation: FP8 operands only (a `ValueError` otherwise; for float32,
        `precision` chooses TF32): run cuBLASLt's FP8 fast accumulation mode
        (``CUBLASLT_MATMUL_DESC_FAST_ACCUM``, nvmath-python's
        `MatmulOptions.fast_accumulation`, what XLA uses for FP8 dots at DEFAULT precision):
        the kernel's partial sums are not periodically promoted to float32, which is faster
        and less accurate, so values may differ from the float32-accumulating reference by
        the accumulation's rounding (more with a longer K). Default False: the products
        accumulate in float32 (SPEC §5). The reference (CPU and other platforms, and the
        CUDA fallbacks) computes the exact float32 formula, so the option changes nothing
        there; `backend="xla"` asks XLA's own FP8 GEMM for the same (DEFAULT precision, which
        XLA runs with fast accumulation, where it is HIGHEST otherwise).

    Returns:
      `y` of shape `(..., M, N)`, or `(y, aux)` where the epilog has auxiliary outputs
      (`relu_aux`, `gelu_aux`, `drelu_bgrad`, `dgelu_bgrad`, `bgrada`, `bgradb`) or
      `result_amax` is asked for.

    Differentiable (reverse mode) for the forward epilogs with 16/32-bit operands; the backward
    epilogs are gradients themselves and FP8 calls are not differentiable: both raise a
    `TypeError` under `jax.grad` (FP8 training: `dense` / `mlp` with ``fp8=``).
    """
    call = _prepare(a, b, epilog, epilog_inputs, transpose_a, transpose_b, precision, backend,
                    quantization_scales, preferred_element_type, result_amax, c, alpha, beta,
                    fast_accumulation)
    axes = manual_axes.varying_axes((call.a, call.b, *call.inputs))  # inside shard_map
    operands = [manual_axes.vary(x, axes) for x in (call.a, call.b, *call.inputs)]
    if Epilog(call.params.epilog).is_backward or is_fp8(call.a.dtype):  # not differentiable
        return _finish(call, _kernel(call.params, *operands))
    scalars = _Scalars(_python_number(alpha, 1.0), _python_number(beta))
    # Traced alpha and beta keep the custom VJP: the plain expression scales in the operands'
    # 16-bit dtype, so JAX would sum their gradients in 16 bits (measured on the H200: d alpha
    # off by 24% and more at 129 x 127), where `_c_gradients` sums in float32.
    # Epilogs that return the ReLU mask or the GELU pre-activation keep the custom VJP too:
    # their gradient follows the mask (1 at 0), whichever GEMMs run.
    constant_scalars = c is None or None not in scalars
    if constant_scalars and not Epilog(call.params.epilog).aux_output and _step_runs_xla(call):
        own = [a, b, *(dict(epilog_inputs or {}).values())]  # as the caller passed them
        if c is None and scalars.alpha == 1.0 and jnp.ndim(b) == 2 and \
                all(jnp.ndim(x) == 1 for x in own[2:]):
            return _users_expression(call.params, *(manual_axes.vary(jnp.asarray(x), axes)
                                                    for x in own))
        return _finish(call, _reference(call.params, *operands, exact=False))
    return _finish(call, _forward(call.params, scalars, *operands))


def reference_matmul(a, b, c=None, *, alpha=None, beta=None, epilog=Epilog.DEFAULT,
                     epilog_inputs=None, transpose_a=False, transpose_b=False, precision=None,
                     quantization_scales=None, preferred_element_type=None, result_amax=False,
                     fast_accumulation=False):
    """`matmul` computed by the plain-JAX reference on any device (same checks, same results;
    `fast_accumulation` is checked and, as on every reference path, changes nothing)."""
    call = _prepare(a, b, epilog, epilog_inputs, transpose_a, transpose_b, precision, "auto",
                    quantization_scales, preferred_element_type, result_amax, c, alpha, beta,
                    fast_accumulation)
    return _finish(call, _reference(call.params, call.a, call.b, *call.inputs))
