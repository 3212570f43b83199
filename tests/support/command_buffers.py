"""A check shared by the GPU tests of the kernel and of autotuning: the kernel runs inside XLA's
command buffers (CUDA graphs) and gives the CPU's results there."""

import os
import subprocess
import sys
import textwrap

COMMAND_BUFFER_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, jax_epilog
    # Full float32, so the GPU and the CPU differ by rounding only (TF32 would not).
    mm = lambda *args, **kw: jax_epilog.matmul(*args, precision="highest", backend="cublaslt", **kw)
    def step(x, w1, b1, w2, b2):
        h, aux = mm(x, w1, epilog="relu_aux_bias", epilog_inputs={"bias": b1})
        y = mm(h, w2, epilog="bias", epilog_inputs={"bias": b2})
        d, g = mm(y, w2, transpose_b=True, epilog="drelu_bgrad",
                  epilog_inputs={"relu_aux": aux["relu_aux"]})
        return y, d, g["drelu_bgrad"]
    rng = np.random.default_rng(0)
    shapes = [(64, 96), (96, 160), (160,), (160, 48), (48,)]
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    f = jax.jit(step)
    got = [f(*args) for _ in range(5)][-1]
    want = jax.jit(step)(*jax.device_put([np.asarray(a) for a in args], jax.devices("cpu")[0]))
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-3)
    print("IN_COMMAND_BUFFER", jax_epilog.runtime.library.captured_executions() > 0)
""")


def run_with_command_buffers(script: str) -> subprocess.CompletedProcess:
    """`script` run by Python in a child process (with the caller's environment) where XLA's
    command buffers are forced on for custom calls and fusions; asserts that it succeeded."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=FUSION,"
                        "CUSTOM_CALL --xla_gpu_graph_min_graph_size=1").strip()
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this test process holds most of the GPU
    done = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def check_kernel_runs_inside_command_buffers():
    """A jitted step of three kernels, run with command buffers forced on, equals the CPU's,
    and the kernel was captured."""
    done = run_with_command_buffers(COMMAND_BUFFER_SCRIPT)
    print(done.stdout[-300:])
    assert "IN_COMMAND_BUFFER True" in done.stdout, done.stdout[-2000:]
