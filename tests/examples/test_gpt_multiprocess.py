"""The GPT example trained data parallel by 2 processes on this machine's CPU
(`train.py --distributed`, `jax.distributed.initialize` with a coordinator on a free local
port): the losses of one process with the same global batch, a checkpoint written once and
restored by both, data parallel with the state replicated, then resumed fully sharded.

Each process starts JAX and compiles the step: about a minute in all, so the slow tier."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "train.py"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
# one block, a loss every step; 4 steps, the first 2 then stopped and resumed
ARGS = ["--config", "tiny", "--impl", "epilog", "--fp8", "--layers", "1", "--steps", "4",
        "--log-every", "1", "--eval-every", "4", "--no-progress"]
TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("XLA_FLAGS", None)  # one CPU device per process
    return env


def _run(n_processes: int, out: Path, *extra) -> list[str]:
    """Runs train.py as `n_processes` processes (one plain process for 1); returns their
    outputs. Every process is killed if one fails or time runs out."""
    port = _free_port()
    commands = [[sys.executable, str(TRAIN), *ARGS, "--out", str(out), *extra]]
    if n_processes > 1:
        commands = [[*commands[0], "--distributed", "--coordinator-address",
                     f"127.0.0.1:{port}", "--num-processes", str(n_processes), "--process-id",
                     str(i)] for i in range(n_processes)]
    procs = [subprocess.Popen(c, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c in commands]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    return outputs


def _losses(path: Path):
    return [loss for _, loss in json.loads(path.read_text())["train_loss"]]


def _data_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@pytest.mark.slow
@pytest.mark.skipif(jax.devices()[0].platform != "cpu" and not os.environ.get("JAX_PLATFORMS"),
                    reason="the processes run on the CPU")
def test_two_processes_train_as_one_and_share_a_checkpoint(tmp_path):
    single = tmp_path / "single.json"
    _run(1, single, "--checkpoint-dir", str(tmp_path / "single_ckpt"), "--checkpoint-every", "2")
    want = _losses(single)

    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first.json", tmp_path / "second.json"
    outputs = _run(2, first, "--checkpoint-dir", str(ckpt), "--stop-after", "2")
    for i, text in enumerate(outputs):
        assert f"process {i} of 2: 1 of 2 devices, resumed from step None" in text, text
    assert sorted(p.name for p in ckpt.iterdir()) == ["2"]
    # written once: the state's bytes are one process's checkpoint's, not one copy each
    assert _data_bytes(ckpt / "2") < 1.5 * _data_bytes(tmp_path / "single_ckpt" / "2")

    # resumed fully sharded: the replicated checkpoint restored into shards of the state
    outputs = _run(2, second, "--checkpoint-dir", str(ckpt), "--fsdp")
    for i, text in enumerate(outputs):
        assert f"process {i} of 2: 1 of 2 devices, resumed from step 2" in text, text
    got = _losses(first) + _losses(second)
    assert len(got) == len(want) == 4
    # The mean over 2 shards of rows, and gradients summed across processes, in another
    # order than one device's: float32 rounding, through 4 AdamW steps.
    assert got == pytest.approx(want, rel=2e-6)
    resumed = json.loads(second.read_text())
    assert resumed["processes"] == 2 and resumed["fully_sharded"]
