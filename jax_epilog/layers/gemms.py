"""A layer's forward GEMM as the stacks issue it (its epilog with the residual the backward
needs, named for remat policies); its backward GEMMs are `matmul`'s `weight_gradient` and
`data_gradient`. Shared by the compute-dtype stack (`layers`) and the FP8 one (`fp8`), whose
choices are made in `plan`.
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
