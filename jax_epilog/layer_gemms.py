"""One layer's GEMMs as the stacks issue them: the forward with its residual, the weight and the
data gradients, and the activation's derivative between them. Shared by the compute-dtype stack
(`layers`) and the FP8 one (`fp8`), which plan which of them run and how in `plan`.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from . import epilogs
from .epilogs import Epilog
from .matmul import matmul
from .plan import Layer, Stack, data_grad_epilog, weight_grad_epilog

#: `checkpoint_name`s of the residuals, for `jax.checkpoint_policies.save_only_these_names`.
RELU_MASK_NAME = "jax_epilog_relu_mask"
GELU_PRE_ACTIVATION_NAME = "jax_epilog_gelu_pre_activation"
LAYER_INPUT_NAME = "jax_epilog_layer_input"


def residual_name(activation: Optional[str]) -> str:
    """The `checkpoint_name` of an activation's residual (mask or pre-activation)."""
    return RELU_MASK_NAME if activation == "relu" else GELU_PRE_ACTIVATION_NAME


def layer_forward(stack: Stack, layer: Layer, h, kernel, bias, keep_residual: bool):
    """(act(h @ kernel + bias), residual or None), in one epilog GEMM."""
    epilog = Epilog.find(layer.activation, layer.has_bias, keep_residual)
    out = matmul(h, kernel, epilog=epilog, precision=stack.precision, backend=stack.forward,
                 epilog_inputs={"bias": bias} if layer.has_bias else None)
    if not epilog.aux_output:
        return out, None
    y, aux = out
    return y, checkpoint_name(aux[epilog.aux_output], residual_name(layer.activation))


def activation_grad(dy, residual, activation: Optional[str]):
    """dZ from dY = d act(Z) (elementwise): the mask for ReLU, gelu'(Z) for GELU."""
    if activation is None:
        return dy
    dz = epilogs.ACTIVATIONS[activation].derivative(dy.astype(jnp.float32), residual, dy.shape[-1])
    return dz.astype(dy.dtype)


def weight_grad(h, dz, with_bias_grad: bool, stack: Stack):
    """(dW = hᵀ dZ, its layer's bias gradient (BGRADB: dZ summed over the rows) or None)."""
    epilog = weight_grad_epilog(with_bias_grad)
    out = matmul(h, dz, transpose_a=True, epilog=epilog, precision=stack.precision,
                 backend=stack.backward)
    return (out[0], out[1]["bgradb"]) if with_bias_grad else (out, None)


def data_grad(dz, kernel, previous: Optional[Layer], residual, stack: Stack):
    """(dZ of the previous layer (dX for the first), its bias gradient or None).

    The bias gradient is None where the previous layer has no bias or no activation (its
    weight-gradient GEMM then gives it through BGRADB).
    """
    epilog = data_grad_epilog(previous)
    if epilog == Epilog.DEFAULT:
        return matmul(dz, kernel, transpose_b=True, precision=stack.precision,
                      backend=stack.backward), None
    out = matmul(dz, kernel, transpose_b=True, epilog=epilog, precision=stack.precision,
                 backend=stack.backward, epilog_inputs={epilog.aux_input: residual})
    return (out[0], out[1][epilog.reduction_output]) if previous.has_bias else (out, None)
