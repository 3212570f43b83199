"""Text that needs no download: the Python standard library's own source files, as bytes.

`load_corpus()` reads every `*.py` under `sysconfig.get_paths()["stdlib"]` (not its
`site-packages`) in sorted order, and splits them into train and validation **by file**: a file
is in validation when a hash of its relative path says so, so the split is the same on every
run and machine for the files they share, and no file is in both. Each split is one in-memory
`uint8` array (the vocabulary is the 256 byte values), the files joined by ASCII's file
separator byte.

`Batches` draws training windows: batch `i` is `batch_size` random windows of `seq_len + 1`
bytes from a generator seeded with `(seed, i)`, so the data order is a function of the seed and
the position alone: resuming at position `i` gives exactly the batches an uninterrupted run
would have seen. `validation_batches` is a fixed set of evenly spaced windows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import numpy as np

FILE_SEPARATOR = 0x1C  # ASCII FS, between files
VOCAB_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Corpus:
    train: np.ndarray       # uint8
    validation: np.ndarray  # uint8
    train_files: tuple[str, ...]       # paths relative to `root`, in the order joined
    validation_files: tuple[str, ...]
    root: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(root: Path) -> list[str]:
    """Every `*.py` under `root` but those in `site-packages`, relative, sorted."""
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*.py")
                  if "site-packages" not in path.relative_to(root).parts and path.is_file())


def in_validation(relative_path: str, validation_percent: float) -> bool:
    """Whether a file belongs to validation: the first 8 bytes of the SHA-256 of its path, as
    a fraction of 2**64, below `validation_percent` / 100 (stable across runs and machines)."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < validation_percent / 100


def _join(root: Path, files: list[str]) -> np.ndarray:
    separator = bytes([FILE_SEPARATOR])
    return np.frombuffer(separator.join((root / f).read_bytes() for f in files), np.uint8)


def load_corpus(root: Optional[Path] = None, validation_percent: float = 5.0) -> Corpus:
    """The standard library's sources (or `root`'s `*.py`), split by file."""
    if not 0 < validation_percent < 100:
        raise ValueError(f"validation_percent: expected a value in (0, 100), got "
                         f"{validation_percent!r}")
    root = Path(root) if root is not None else stdlib_root()
    files = source_files(root)
    validation = [f for f in files if in_validation(f, validation_percent)]
    train = [f for f in files if not in_validation(f, validation_percent)]
    if not train or not validation:
        raise ValueError(f"root: {root} has {len(files)} *.py files, too few to split into "
                         f"train and validation at {validation_percent}%")
    return Corpus(_join(root, train), _join(root, validation), tuple(train),
                  tuple(validation), str(root))


def _check_fits(data: np.ndarray, seq_len: int, name: str) -> None:
    if len(data) < seq_len + 1:
        raise ValueError(f"seq_len: {seq_len} + 1 bytes do not fit in the {name} split "
                         f"({len(data)} bytes)")


def windows(data: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), int32 `(len(starts), seq_len)`: the bytes from each start, and the
    bytes one further (next-byte prediction)."""
    rows = data[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return rows[:, :-1], rows[:, 1:]


@dataclasses.dataclass
class Batches:
    """Random training windows; `position` is the next batch's index (the loader's whole
    state, saved in checkpoints)."""

    data: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    position: int = 0

    def __post_init__(self):
        _check_fits(self.data, self.seq_len, "train")

    def batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, index])
        starts = rng.integers(0, len(self.data) - self.seq_len, size=self.batch_size)
        return windows(self.data, starts, self.seq_len)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        batch = self.batch(self.position)
        self.position += 1
        return batch


def validation_batches(data: np.ndarray, batch_size: int, seq_len: int,
                       n_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n_batches` batches of windows spread evenly over the validation split: the same ones at
    every evaluation, so validation losses compare across steps and runs."""
    _check_fits(data, seq_len, "validation")
    starts = np.linspace(0, len(data) - seq_len - 1, n_batches * batch_size).astype(np.int64)
    return [windows(data, chunk, seq_len) for chunk in starts.reshape(n_batches, batch_size)]
