"""`serve_fp8`: a stock Flax model served in FP8 by one call, its code unchanged
(docs/stock_models.md, "Serving").

Rules choose layers by module path (a regex over "blocks/0/mlp/up", as Qwix's rules do); each
chosen `nnx.Linear`, `nnx.LinearGeneral`, `nnx.Einsum`, `linen.Dense`, `linen.DenseGeneral`
or `linen.Einsum` has its kernel stored in FP8 once (`stock_layers.stored_kernel`, an
`Fp8Weight`) and its computation replaced by the served forward (`stock_layers.served_forward`:
the way the serving planner chooses for the rows, the layer's bias in the GEMM's epilog).

- NNX: the model is cloned and each chosen layer's class becomes a subclass of its own
  (`ServedLinear`, ...) whose `__call__` is the served forward. Attribute names, state paths
  and `isinstance` stay; the kernel `Param` holds the `Fp8Weight`.
- Linen: the parameters' chosen kernels become `Fp8Weight`s, found by tracing the module once
  on sample inputs (Linen knows its layers only when it runs); the returned module is a copy
  whose methods run under `flax.linen.intercept_methods(intercept)`, which serves each stock
  layer whose kernel is an `Fp8Weight` and leaves every other module alone.

A chosen layer the route cannot take (`stock_layers.why_not`) stays 16-bit with a
`StockServingWarning` naming its path, or raises a `ValueError` naming it where the rules
asked for it explicitly (`strict=True`, or a rule whose path is a plain string, no regex).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional, Union

import jax
from flax import linen, nnx

from jax_epilog.float8.recipe import fp8_format
from jax_epilog.float8.weights import MIN_FEATURES, Fp8Weight, _check_granularity
from jax_epilog.layers import stock_layers
from jax_epilog.layers.stock_layers import kernel_value, stock_kind


class StockServingWarning(UserWarning):
    """A layer the rules chose stays 16-bit; the message names it and says why."""


@dataclasses.dataclass(frozen=True)
class ServeRule:
    """Which layers `serve_fp8` serves in FP8.

    Attributes:
      module_path: a regex matched in full against a layer's path, its names joined by "/"
        ("blocks/0/attention/qkv"; Linen: the module's `path`, "Dense_0" for an unnamed one).
        A plain string (no regex character) names one layer: asked for explicitly, so a
        failure to serve it raises.
      serve: False keeps the matched layers 16-bit (an exclusion; rules are tried in order,
        the first match decides).
      min_features: a matched layer is served only where its GEMM's K and N are both at least
        this (`quantize_params`' default rule: `MIN_FEATURES`).
    """

    module_path: str = ".*"
    serve: bool = True
    min_features: int = 0

    def __post_init__(self):
        try:
            re.compile(self.module_path)
        except re.error as error:
            raise ValueError(f"module_path: {self.module_path!r} is not a regex ({error})") \
                from None

    @property
    def explicit(self) -> bool:
        """Whether the rule names one path (no regex character in it)."""
        return re.escape(self.module_path) == self.module_path


#: `serve_fp8`'s rules where none are given: every stock layer whose GEMM's K and N are both
#: at least `MIN_FEATURES`, as `quantize_params`' default.
DEFAULT_RULES = (ServeRule(".*", min_features=MIN_FEATURES),)

#: What `rules=` takes: a rule, a path regex, or a sequence of them (None: `DEFAULT_RULES`).
Rules = Union[ServeRule, str, Sequence[Union[ServeRule, str]], None]


def as_rules(rules: Rules) -> tuple[ServeRule, ...]:
    """`rules` (None, a `ServeRule` or path regex, or a sequence of them) as `ServeRule`s."""
    if rules is None:
        return DEFAULT_RULES
    if isinstance(rules, (ServeRule, str)):
        rules = [rules]
    if not isinstance(rules, Sequence) or not rules:
        raise TypeError(f"rules: expected a ServeRule, a path regex or a non-empty sequence of "
                        f"them, got {rules!r}")
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, str):
            rule = ServeRule(rule)
        if not isinstance(rule, ServeRule):
            raise TypeError(f"rules[{i}]: expected a ServeRule or a path regex, got {rule!r}")
        out.append(rule)
    return tuple(out)


def path_string(path) -> str:
    """A module path as rules match it: its names joined by "/" ("" for the model itself)."""
    return "/".join(str(name) for name in path)


def shown(path: str) -> str:
    """`path` for a message: the model itself has the empty path."""
    return path or "(the model itself)"


@dataclasses.dataclass
class Choice:
    """The rules' choice over a model's stock layers."""

    rules: tuple[ServeRule, ...]
    strict: bool
    matched: set = dataclasses.field(default_factory=set)

    def chooses(self, path: str, module, kind: str, kernel) -> bool:
        """Whether the layer at `path` is served: the first rule matching it says so, its GEMM
        is large enough, and the route can take it (else a warning or, asked for
        explicitly, a `ValueError` naming `path`)."""
        rule = self.rule(path)
        if rule is None or not rule.serve:
            return False
        reason = stock_layers.why_not(module, kind, kernel)
        if reason is not None:
            return self.refuse(path, rule, reason)
        lay = stock_layers.gemm_layout(module, kind, kernel)
        return min(lay.k, lay.n) >= rule.min_features

    def rule(self, path: str) -> Optional[ServeRule]:
        """The first rule matching `path` (recorded as matched), or None."""
        rule = next((r for r in self.rules if re.fullmatch(r.module_path, path)), None)
        if rule is not None:
            self.matched.add(rule)
        return rule

    def refuse(self, path: str, rule: Optional[ServeRule], reason: str) -> bool:
        """False, after a `StockServingWarning` naming `path` and `reason` where `rule` would
        serve it, or a `ValueError` where it asked for it explicitly."""
        if rule is None or not rule.serve:
            return False
        if self.strict or rule.explicit:
            raise ValueError(f"{shown(path)}: cannot be served in FP8: {reason} (rule "
                             f"{rule.module_path!r}); leave it out of the rules to keep it "
                             "16-bit")
        warnings.warn(f"{shown(path)} stays 16-bit: {reason}", StockServingWarning,
                      stacklevel=5)
        return False

    def check_all_matched(self, paths) -> None:
        """A rule naming one path that matched none raises (a typo would serve nothing)."""
        for rule in self.rules:
            if rule.explicit and rule not in self.matched:
                known = ", ".join(sorted(paths)[:12]) or "none"
                raise ValueError(f"rules: {rule.module_path!r} names no stock dense layer of "
                                 f"the model (its layers: {known})")


def serve_fp8(model, *args, rules: Rules = None, strict: bool = False,
              dtype="float8_e4m3fn", granularity: str = "tensor", **kwargs):
    """A stock Flax model served in FP8, its code unchanged.

    NNX: `served = serve_fp8(model, rules=...)`, a copy of `model` (which is unchanged) whose
    chosen layers run the served FP8 forward; `served(x)` as `model(x)`, under `nnx.jit` too.

    Linen: `served, variables = serve_fp8(module, variables, x, rules=...)`, then
    `served.apply(variables, x)` as `module.apply`. The sample arguments after `variables`
    are what `module.apply(variables, ...)` takes, keywords included (traced
    abstractly, once, to find the layers); `variables` is the whole `{"params": ...}` (or the
    params alone), returned in the same form with the chosen kernels stored as `Fp8Weight` leaves.

    Args:
      rules: which layers: None (every stock layer whose K and N are both at least
        `MIN_FEATURES`), a `ServeRule`, a path regex, or a sequence of them (first match
        decides).
      strict: every chosen layer must be served; one that cannot raises a `ValueError`
        naming it (without `strict`, only those a plain-path rule names do; the others stay
        16-bit with a `StockServingWarning`).
      dtype, granularity: as `quantize_params`': the stored format and one scale per kernel
        ("tensor") or per output channel ("channel").
    """
    dtype = fp8_format("dtype", dtype)
    _check_granularity(granularity)
    if isinstance(model, linen.Module):
        if not args:
            raise TypeError("serve_fp8: a Linen module takes its variables and sample inputs: "
                            "serve_fp8(module, variables, *sample_args)")
        return _serve_linen(model, args[0], args[1:], kwargs, as_rules(rules), strict, dtype,
                            granularity)
    if isinstance(model, nnx.Module):
        if args or kwargs:
            raise TypeError("serve_fp8: an NNX model takes no inputs (its layers are known); "
                            f"got {len(args)} positional and {sorted(kwargs)} keyword ones")
        return _serve_nnx(model, as_rules(rules), strict, dtype, granularity)
    raise TypeError(f"model: expected a flax.nnx.Module or flax.linen.Module, got "
                    f"{type(model).__name__}")


# --- NNX ---------------------------------------------------------------------------------------

def _serve_nnx(model, rules, strict, dtype, granularity):
    served = nnx.clone(model)
    choice = Choice(rules, strict)
    paths = []
    for path, module in nnx.iter_modules(served):
        name, kind = path_string(path), stock_kind(module)
        custom = stock_layers.overridden_call(module)
        if custom is not None:
            choice.refuse(name, choice.rule(name), custom)
        if kind is None or getattr(type(module), "_jax_epilog_unserved", None) is not None:
            continue
        paths.append(name)
        kernel = kernel_value(module.kernel)
        if not choice.chooses(name, module, kind, kernel):
            continue
        serve_nnx_layer(module, kind, kernel, name, dtype, granularity)
    choice.check_all_matched(paths)
    return served


def serve_nnx_layer(module, kind: str, kernel, path: str, dtype, granularity: str) -> None:
    """Stores `module`'s kernel in FP8 and swaps its class for its served subclass."""
    module.kernel = nnx.Param(stock_layers.stored_kernel(
        module, kind, kernel, name=f"{shown(path)}/kernel", dtype=dtype,
        granularity=granularity))
    module.served_path = shown(path)
    module.__class__ = served_nnx_class(type(module))


def _served_nnx_call(self, inputs, *args, **kwargs):
    """The served layer's `__call__`: the stock signature (`out_sharding`, an einsum's
    `einsum_str`), the stock computation where the kernel is not an `Fp8Weight`."""
    kernel = kernel_value(self.kernel)
    unserved = type(self)._jax_epilog_unserved
    if not isinstance(kernel, Fp8Weight):
        return unserved.__call__(self, inputs, *args, **kwargs)
    kind = stock_kind(self)
    names = ("einsum_str", "out_sharding") if kind == "einsum" else ("out_sharding",)
    given = dict(zip(names, args), **kwargs)
    if set(given) - set(names) or len(args) > len(names):
        raise TypeError(f"{self.served_path}: unexpected arguments {sorted(given)}")
    if given.get("out_sharding") is not None:
        raise ValueError(f"{self.served_path}: out_sharding is not supported by the served "
                         "FP8 layer; shard the input instead")
    bias = None if self.bias is None else kernel_value(self.bias)
    return stock_layers.served_forward(self, kind, inputs, kernel, bias, path=self.served_path,
                                       einsum_str=given.get("einsum_str"))


@functools.cache
def served_nnx_class(cls: type) -> type:
    """`cls`'s served subclass (one per class, so graph definitions of served models compare
    equal and `nnx.jit` reuses its compilations)."""
    return type(f"Served{cls.__name__}", (cls,), {
        "__call__": _served_nnx_call, "_jax_epilog_unserved": cls,
        "__module__": __name__, "__doc__": f"`{cls.__qualname__}` served in FP8 "
                                            "(jax_epilog.serve_fp8)."})


# --- Linen -------------------------------------------------------------------------------------

def intercept(next_fun, args, kwargs, context):
    """A `flax.linen.intercept_methods` interceptor: a stock layer's `__call__` whose kernel is
    an `Fp8Weight` runs the served forward; everything else runs as it is."""
    module = context.module
    kind = stock_kind(module) if context.method_name == "__call__" else None
    if kind is None or not module.has_variable("params", "kernel"):
        return next_fun(*args, **kwargs)
    kernel = kernel_value(module.get_variable("params", "kernel"))
    if not isinstance(kernel, Fp8Weight):
        return next_fun(*args, **kwargs)
    bias = kernel_value(module.get_variable("params", "bias")) \
        if module.has_variable("params", "bias") else None
    inputs, *rest = args
    einsum_str = kwargs.get("einsum_str", rest[0] if rest else None)
    return stock_layers.served_forward(module, kind, inputs, kernel, bias,
                                       path=shown(path_string(module.path)),
                                       einsum_str=einsum_str)


@contextlib.contextmanager
def intercepted():
    """Within it, every Linen stock layer whose kernel is an `Fp8Weight` runs served: for a
    served module applied inside a larger one (`serve_fp8`'s returned module does this
    itself)."""
    with linen.intercept_methods(intercept):
        yield


def _linen_layers(module, variables, args, kwargs) -> dict[tuple, Any]:
    """{path: the bound stock layer} of every stock layer `module.apply` runs on the sample
    inputs (traced abstractly)."""
    found = {}

    def record(next_fun, call_args, call_kwargs, context):
        module = context.module
        if context.method_name == "__call__" and (
                stock_kind(module) is not None or stock_layers.overridden_call(module)):
            found.setdefault(tuple(module.path), module)
        return next_fun(*call_args, **call_kwargs)

    def run(variables):
        with linen.intercept_methods(record):
            return module.apply(variables, *args, **kwargs)

    jax.eval_shape(run, variables)
    return found


def _serve_linen(module, variables, args, kwargs, rules, strict, dtype, granularity):
    whole = isinstance(variables, dict) or hasattr(variables, "unfreeze")
    if not whole:
        raise TypeError(f"variables: expected Linen's variables or params (a dict), got "
                        f"{type(variables).__name__}")
    has_params = "params" in variables
    full = variables if has_params else {"params": variables}
    layers = _linen_layers(module, full, args, kwargs)
    params = _unfrozen(full["params"])
    choice = Choice(rules, strict)
    for path, layer in layers.items():
        name = path_string(path)
        custom = stock_layers.overridden_call(layer)
        if custom is not None:
            choice.refuse(name, choice.rule(name), custom)
            continue
        owner = params
        for key in path:
            owner = owner[key]
        kernel = kernel_value(owner["kernel"])
        if isinstance(kernel, Fp8Weight):
            continue
        kind = stock_kind(layer)
        if choice.chooses(name, layer, kind, kernel):
            owner["kernel"] = stock_layers.stored_kernel(
                layer, kind, kernel, name=f"{name}/kernel", dtype=dtype,
                granularity=granularity)
    choice.check_all_matched([path_string(p) for p, layer in layers.items()
                              if stock_kind(layer) is not None])
    params = type(full["params"])(params) if hasattr(full["params"], "unfreeze") else params
    out = {**full, "params": params} if has_params else params
    out = type(variables)(out) if hasattr(variables, "unfreeze") and has_params else out
    return served_linen_module(module), out


def _unfrozen(tree):
    """A mutable nested-dict copy of `tree` (leaves shared)."""
    if hasattr(tree, "unfreeze"):
        tree = tree.unfreeze()
    if isinstance(tree, dict):
        return {key: _unfrozen(value) for key, value in tree.items()}
    return tree


def served_linen_module(module: linen.Module, methods: Sequence[str] = ("__call__",)):
    """A copy of `module` whose `methods` run under `intercepted()` (as Qwix intercepts a
    Linen model: the class is replaced by a subclass, since `apply` runs a clone)."""
    cls = type(module)
    base = getattr(cls, "_jax_epilog_unserved", cls)
    fields = {"_jax_epilog_unserved": base}
    for name in methods:
        method, wrapped = getattr(base, name), False
        while hasattr(method, "method_handler_wrapped"):
            method, wrapped = method.__wrapped__, True

        run = _intercepting(method, name)
        fields[name] = linen.module.wrap_method_once(run) if wrapped else run
    served = module.copy()
    served.__class__ = type(base.__name__, (base,), fields)
    return served


class _Context(NamedTuple):
    """What `intercept` reads of `flax.linen.intercept_methods`' context."""

    module: linen.Module
    method_name: str


def _intercepting(method, name: str):
    """`method` run under `intercepted()`, itself intercepted too (the served module may be a
    stock layer)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with intercepted():
            return intercept(functools.partial(method, self), args, kwargs,
                             _Context(self, name))
    return run
