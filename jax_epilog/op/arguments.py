"""The checks of `matmul`'s arguments, made once, with errors that name the argument, and the
reshape (never a copy) of the user's arrays into the kernel's rank-3 form: a 2-D `b` shared
by every leading index of `a` folds those indices into M, so the whole call is one GEMM;
otherwise leading dims become one strided batch. `prepare` gives the checked call (`Call`:
its `Params` and normalised operands), `shape_results` takes the kernel's outputs back to the
user's shapes. What each epilog reads and writes comes from `epilogs.TABLE`.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog.op import block_scales
from jax_epilog.op.call import Params
from jax_epilog.op.epilogs import (ARRAYS, DEFAULT_FP8_RESULT, FP8_DTYPES, FP8_RESULT_DTYPES,
                                   Epilog, array_dtype, as_epilog, dim_sizes, is_fp8,
                                   result_names, scale_names)
from jax_epilog.runtime.settings import BACKENDS

SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
#: Operand dtypes: SUPPORTED_DTYPES, and the FP8 formats with `quantization_scales` (SPEC §5).
OPERAND_DTYPES = SUPPORTED_DTYPES + tuple(jnp.dtype(d) for d in FP8_DTYPES)



# --- argument checks --------------------------------------------------------------------------

def _raw_dtype(x) -> np.dtype:
    dtype = getattr(x, "dtype", None)
    return jnp.dtype(np.asarray(x).dtype if dtype is None else dtype)


def _as_operand(name: str, x):
    """`x` as an array of a supported dtype and rank >= 2."""
    dtype = getattr(x, "dtype", None)
    dtype = _raw_dtype(x) if dtype is None else jnp.dtype(dtype)
    if dtype not in OPERAND_DTYPES:
        extra = ""
        if isinstance(x, (list, tuple)) and x is not None:
            extra = (f" (a Python {type(x).__name__} becomes {dtype} in NumPy; pass "
                     f"jnp.asarray({name}, dtype=jnp.float32), or bfloat16 / float16)")
        elif dtype == jnp.float64:
            extra = " (float64 is not supported by cuBLASLt's epilogs; cast to float32)"
        raise TypeError(f"{name}: expected dtype float16, bfloat16 or float32, got {dtype}{extra}"
                        " (or FP8: float8_e4m3fn / float8_e5m2 with quantization_scales)")
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


def _check_epilog_input_names(epilog: Epilog, epilog_inputs) -> None:
    """Raises where `epilog_inputs` does not name exactly the epilog's inputs."""
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


def _checked_inputs(epilog: Epilog, epilog_inputs, out, lead: tuple, m: int,
                    n: int) -> dict[str, Any]:
    """The epilog's inputs (named as it needs) as arrays, each of its dtype and of one of the
    shapes it may have: the kernel's, with `lead` for its batch."""
    checked = {}
    sizes = dim_sizes(1, m, n) if epilog.input_names else {}
    for name in epilog.input_names:
        x, dtype = epilog_inputs[name], array_dtype(name, out)
        label, what = f"epilog_inputs['{name}']", f"{ARRAYS[name].what} for N={n}"
        got = getattr(x, "dtype", None)
        got = _raw_dtype(x) if got is None else jnp.dtype(got)
        if got != dtype:
            hint = ("; a boolean mask is packed into cuBLASLt's layout by "
                    "jax_epilog.pack_relu_mask(mask)") if name == "relu_aux" and got == bool else ""
            raise TypeError(f"{label}: expected dtype {jnp.dtype(dtype)} ({what}), got "
                            f"{got}{hint}")
        x = jnp.asarray(x)
        dims = ARRAYS[name].dims
        rest = tuple(sizes[d] for d in dims[1:])
        shapes = [rest, (*lead, *rest)] if dims[0] == "bias_batch" else [(*lead, *rest)]
        if tuple(x.shape) not in shapes:
            expected = " or ".join(str(s) for s in dict.fromkeys(shapes))
            raise ValueError(f"{label}: expected shape {expected} ({what}), got "
                             f"{tuple(x.shape)}")
        checked[name] = x
    return checked


class Call(NamedTuple):
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
    given = [quantization_scales[k] for k in ("a", "b")]
    blocks = [block_scales.is_block_scales(x) for x in given]
    if any(blocks):
        if not all(blocks):
            plain = "b" if blocks[0] else "a"
            raise TypeError(f"quantization_scales[{plain!r}]: with block scales for the other "
                            "operand this one needs BlockScales too (jax_epilog.quantize_1x128 "
                            "or quantize_128x128); per-tensor and block scales do not mix")
        return tuple(given)  # checked against the operands' shapes in `prepare`
    scales = [_check_scale(k, x) for k, x in zip(("a", "b"), given)]
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


#: Keywords users reach for that `matmul` takes under another name, and what to write instead.
_OTHER_NAMES = {
    "bias": 'epilog_inputs={"bias": b} with an epilog that adds one (e.g. epilog="bias", '
            '"relu_bias" or "gelu_bias")',
    "activation": 'epilog="relu" / "gelu" (or "relu_bias" / "gelu_bias" with a bias)',
    "preferred_dtype": "preferred_element_type= (FP8 operands only)",
}


def keyword_hints(fn):
    """`fn` (matmul or reference_matmul), whose unknown keywords raise a TypeError that says
    what to write instead, where the keyword is one users reach for (`_OTHER_NAMES`)."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        unknown = [k for k in kwargs if k not in signature.parameters]
        for name in unknown:
            hint = _OTHER_NAMES.get(name)
            if hint:
                raise TypeError(f"{fn.__name__}() takes no {name}= argument: pass {hint}")
        return fn(*args, **kwargs)

    return checked


def prepare(a, b, epilog, epilog_inputs, transpose_a, transpose_b, precision,
             backend="auto", quantization_scales=None, preferred_element_type=None,
             result_amax=False, c=None, alpha=None, beta=None,
             fast_accumulation=False) -> Call:
    """The checked call. The checks of arguments left at their defaults are skipped (they
    would pass): a plain 16-bit call meets only those of its operands and epilog."""
    epilog = as_epilog(epilog)
    a = _as_operand("a", a)
    b = _as_operand("b", b)
    fp8 = _check_operand_dtypes(a, b)
    out = (a.dtype if not fp8 and preferred_element_type is None else
           _result_dtype(fp8, a.dtype, preferred_element_type))
    scales = (_check_scales(fp8, out, quantization_scales, result_amax)
              if fp8 or quantization_scales is not None or result_amax is not False else ())
    if fast_accumulation is not False:
        fast_accumulation = _check_fast_accumulation(fast_accumulation, a.dtype)
    for name, flag in (("transpose_a", transpose_a), ("transpose_b", transpose_b)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, got {flag!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    names = set() if epilog_inputs is None else (
        set(epilog_inputs) if isinstance(epilog_inputs, Mapping) else None)
    if names != set(epilog.input_names):
        _check_epilog_input_names(epilog, epilog_inputs)  # raises, naming what is wrong

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
    blocks = None
    if scales and block_scales.is_block_scales(scales[0]):
        blocks = (scales[0].block, scales[1].block)
        block_scales.check_call(blocks, k, epilog=epilog, has_c=c is not None, result_dtype=out,
                                result_amax=bool(result_amax),
                                fast_accumulation=fast_accumulation,
                                batched=a.ndim != 2 or b.ndim != 2)
        scales = (block_scales.check_values("a", scales[0], m, k),
                  block_scales.check_values("b", scales[1], n, k))
    c_operands = (() if c is None and alpha is None and beta is None else
                  _check_c(c, alpha, beta, out, lead, m, n))
    checked = _checked_inputs(epilog, epilog_inputs, out, lead, m, n)

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
    params = Params(epilog, bool(transpose_a), bool(transpose_b),
                    a.dtype == jnp.float32 and allow_tf32_for(precision, a.dtype), backend,
                    result_dtype=out.name if fp8 else None, result_amax=bool(result_amax),
                    has_c=bool(c_operands), fast_accumulation=fast_accumulation,
                    block_scaling=blocks)
    return Call(a3, b3, kernel_inputs, params, lead, m, n, b_shared)


def shape_results(call: Call, outputs):
    """Shape the kernel's outputs back to the user's leading dims."""
    epilog = call.params.epilog
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


def _sum_over_k(call: Call, dtype):
    """b summed over K (times its FP8 scale), for BGRADB of an empty batch (no kernel row to
    read it from)."""
    b2 = call.b[0]
    total = jnp.sum(b2.astype(jnp.float32), axis=1 if call.params.transpose_b else 0)
    if is_fp8(b2.dtype):  # the scales follow the epilog's inputs: a's, then b's
        total = total * call.inputs[len(call.params.epilog.input_names) + 1]
    return total.astype(dtype)


# --- the kernel call and its gradient -----------------------------------------------------
