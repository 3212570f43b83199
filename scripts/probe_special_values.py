"""Print what the cuBLASLt kernel does with special pre-activation values, next to the reference.

For z in {NaN, +Inf, -Inf, +0, -0, ±tiny, ±1}: y and the mask bit of RELU_AUX, and
GELU(z). Run on a GPU machine; the reference's answers come from the CPU device.
"""

import jax
import jax.numpy as jnp
import numpy as np

import jax_epilog

VALUES = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30, -1e-30, 1.0, -1.0], np.float32)


def run(device):
    # K = 1 and a = [[1]]: the product is exactly the values, one per column.
    a = jnp.ones((1, 1), jnp.float32)
    b = jnp.asarray(VALUES[None, :], jnp.float32)
    a, b = jax.device_put((a, b), device)
    y, aux = jax_epilog.matmul(a, b, epilog="relu_aux", precision="highest")
    g = jax_epilog.matmul(a, b, epilog="gelu", precision="highest")
    mask = np.asarray(aux["relu_aux"])[0]
    bits = np.array([(mask[j // 8] >> (j % 8)) & 1 for j in range(len(VALUES))])
    return np.asarray(y)[0], bits, np.asarray(g)[0]


gpu = run(jax.devices()[0])
cpu = run(jax.devices("cpu")[0])
print(f"device: {jax.devices()[0]}")
print(f"{'z':>10} | {'relu gpu':>10} {'relu cpu':>10} | {'bit gpu':>7} {'bit cpu':>7} | "
      f"{'gelu gpu':>10} {'gelu cpu':>10}")
for i, z in enumerate(VALUES):
    print(f"{z:>10.3g} | {gpu[0][i]:>10.3g} {cpu[0][i]:>10.3g} | {gpu[1][i]:>7} {cpu[1][i]:>7} | "
          f"{gpu[2][i]:>10.3g} {cpu[2][i]:>10.3g}")
