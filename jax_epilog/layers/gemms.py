"""A layer's GEMMs as the stacks issue them: its forward (`layer_forward`: its epilog with the
residual the backward needs, named for remat policies) and its backward (`weight_gradient`,
`data_gradient`: `matmul` calls, so `backend="auto"` picks cuBLASLt's epilog or XLA's GEMM per
problem, and 16-bit operands stay 16-bit). Shared by the compute-dtype stack (`functional`) and
the FP8 one (`fp8_step`), whose choices are made in `planning.stack_plan`.
"""

from __future__ import annotations

from typing import Optional

from jax.ad_checkpoint import checkpoint_name

from jax_epilog.op.epilogs import Epilog
from jax_epilog.op.matmul import matmul
from jax_epilog.planning.stack_plan import Layer, Stack

#: `checkpoint_name`s of the residuals, for `jax.checkpoint_policies.save_only_these_names`.
RELU_MASK_NAME = "jax_epilog_relu_mask"
GELU_PRE_ACTIVATION_NAME = "jax_epilog_gelu_pre_activation"
LAYER_INPUT_NAME = "jax_epilog_layer_input"
#: The SwiGLU block's saved hidden activations (`[g u]`; g8, u8, h8 under FP8); its input is
#: saved as `LAYER_INPUT_NAME`, as the stacks' are.
SWIGLU_HIDDEN_NAME = "jax_epilog_swiglu_hidden"


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


def weight_gradient(h, dz, *, bias_gradient: bool, precision, backend: str):
    """(dW, dbias or None) for a layer's Z = h @ W: dW = hᵀ dZ (K, N), and the bias gradient,
    dZ summed over the rows, from the same GEMM (BGRADB)."""
    out = matmul(h, dz, transpose_a=True, precision=precision, backend=backend,
                 epilog=Epilog.BGRADB if bias_gradient else Epilog.DEFAULT)
    return (out[0], out[1]["bgradb"]) if bias_gradient else (out, None)


def data_gradient(dz, w, *, precision, backend: str, activation: Optional[str] = None,
                  has_bias: bool = False, residual=None):
    """(dX, dbias or None) for a layer's Z = X @ W: dX = dZ Wᵀ. With the `activation` of the
    layer below (its `residual` kept by the forward), the same GEMM applies its derivative and,
    where that layer `has_bias`, reduces its bias gradient (DRELU_BGRAD / DGELU_BGRAD, DRELU /
    DGELU without a bias)."""
    if activation is None:
        return matmul(dz, w, transpose_b=True, precision=precision, backend=backend), None
    epilog = Epilog.find_derivative(activation, bias_gradient=has_bias)
    out = matmul(dz, w, transpose_b=True, epilog=epilog, precision=precision, backend=backend,
                 epilog_inputs={epilog.aux_input: residual})
    return (out[0], out[1][epilog.reduction_output]) if has_bias else (out, None)
