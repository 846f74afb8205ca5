"""The language-model recipe's corpus and data: Debian's fortune cookies, split by document, cut into byte windows.

The corpus is the 43 files that Debian's ``fortunes`` package (with ``fortunes-min``, which it depends on)
installs in ``/usr/share/games/fortunes``: 15,256 fortunes (quotations, jokes, poems, definitions, a little ASCII
art) in 2.6 MB of text. A document is one fortune, the text between two ``%`` lines of a file. Only those 43
files are read, whatever other ``fortunes-*`` packages put beside them, so the corpus is the same on every machine
with the package.

The split is by document, with no seed: a fortune is a validation document where the CRC-32 of its text is 0
modulo :data:`VALIDATION_EVERY` (about 5% of them), else a training one. A fortune that two files hold twice is in
one split, and the split stays the same whatever order the files are read in. Each split's documents are joined
into one stream of bytes, each followed by the files' own ``%`` line; a sample is a window of ``context + 1``
bytes of it, the model's input its first ``context`` bytes and the target its last ``context`` (the input
shifted by one).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from plug_asgd.recipes.idx import DatasetNotFoundError

__all__ = [
    "FORTUNES_DIR",
    "FORTUNE_FILES",
    "PACKAGE",
    "SEPARATOR",
    "VALIDATION_EVERY",
    "ByteWindows",
    "CorpusNotFoundError",
    "Document",
    "FortunesDataModule",
    "evenly_spaced_offsets",
    "find_corpus",
    "is_validation",
    "random_offsets",
    "read_documents",
    "split_documents",
    "to_stream",
]

PACKAGE = "fortunes"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
# what Debian's fortunes (1:1.99.1) and fortunes-min install in FORTUNES_DIR, less the .dat indexes and .u8 links
FORTUNE_FILES: tuple[str, ...] = (
    "art", "ascii-art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs", "education",
    "ethnic", "food", "fortunes", "goedel", "humorists", "kids", "knghtbrd", "law", "linux", "linuxcookie",
    "literature", "love", "magic", "medicine", "men-women", "miscellaneous", "news", "paradoxum", "people", "perl",
    "pets", "platitudes", "politics", "pratchett", "riddles", "science", "songs-poems", "sports", "startrek", "tao",
    "translate-me", "wisdom", "work", "zippy",
)
VALIDATION_EVERY = 20
SEPARATOR = b"%\n"


class CorpusNotFoundError(DatasetNotFoundError):
    """The corpus's files are not in the folder given (the ``fortunes`` package is not installed there)."""


@dataclass(frozen=True)
class Document:
    """One fortune.

    Attributes:
        name: where it comes from: its file's name and its index there (``"science:12"``).
        text: its bytes, ending with a newline, without the ``%`` lines around it.
    """

    name: str
    text: bytes


def find_corpus(data_dir: str | os.PathLike[str]) -> Path:
    """The folder holding every file of :data:`FORTUNE_FILES`, ``data_dir`` itself.

    Args:
        data_dir: the folder to look in (``~`` expanded).

    Raises:
        CorpusNotFoundError: where a file is missing, with the package to install and the setup script.
    """
    folder = Path(data_dir).expanduser()
    missing = [name for name in FORTUNE_FILES if not (folder / name).is_file()]
    if missing:
        what = "none of its files" if len(missing) == len(FORTUNE_FILES) else f"no {', '.join(missing[:5])}" + (
            f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise CorpusNotFoundError(
            f"the language model's corpus was not found in {folder} ({what}): it is Debian's {PACKAGE!r} package; "
            f"run scripts/setup.sh (as root or with password-less sudo) or `sudo apt-get install {PACKAGE}`, which "
            f"installs it in {FORTUNES_DIR}, or pass --data-dir to a folder holding its files")
    return folder


def _fortunes(raw: bytes) -> list[bytes]:
    """The fortunes of one file: the texts between its ``%`` lines, empty ones dropped, each ending with a newline."""
    out: list[bytes] = []
    current: list[bytes] = []
    for line in raw.splitlines(keepends=True):
        if line.rstrip(b"\r\n") == b"%":
            out.append(b"".join(current))
            current = []
        else:
            current.append(line)
    out.append(b"".join(current))
    return [text if text.endswith(b"\n") else text + b"\n" for text in out if text.strip()]


def read_documents(data_dir: str | os.PathLike[str] = FORTUNES_DIR) -> list[Document]:
    """Every fortune of the corpus, file by file in :data:`FORTUNE_FILES`' order.

    Args:
        data_dir: the folder holding the corpus's files.

    Raises:
        CorpusNotFoundError: where a file of the corpus is missing.
    """
    folder = find_corpus(data_dir)
    return [Document(f"{name}:{i}", text) for name in FORTUNE_FILES
            for i, text in enumerate(_fortunes((folder / name).read_bytes()))]


def is_validation(document: Document) -> bool:
    """Whether ``document`` is a validation document: the CRC-32 of its text is 0 modulo :data:`VALIDATION_EVERY`.

    Args:
        document: the fortune.
    """
    return zlib.crc32(document.text) % VALIDATION_EVERY == 0


def split_documents(documents: list[Document]) -> tuple[list[Document], list[Document]]:
    """``(train, validation)``: each document in one of them by :func:`is_validation`, each list in input order.

    Args:
        documents: the corpus's documents.
    """
    validation = [d for d in documents if is_validation(d)]
    return [d for d in documents if not is_validation(d)], validation


def to_stream(documents: list[Document]) -> np.ndarray:
    """The documents' bytes as one uint8 array, each followed by :data:`SEPARATOR` (as the files hold them).

    Args:
        documents: the documents, in the order they are joined.
    """
    return np.frombuffer(b"".join(d.text + SEPARATOR for d in documents), dtype=np.uint8)


def random_offsets(length: int, context: int, count: int, seed: int) -> np.ndarray:
    """``count`` start offsets of windows of ``context + 1`` bytes, drawn uniformly from a stream of ``length``.

    Args:
        length: the stream's bytes.
        context: the model's input length; each window holds one byte more.
        count: how many offsets.
        seed: seeds the draw (the same offsets on every rank).

    Raises:
        ValueError: where the stream is shorter than a window, or ``count`` is not positive.
    """
    _check_window(length, context)
    if count < 1:
        raise ValueError(f"the number of training windows must be positive, got {count}")
    return np.random.default_rng([seed, 0x4C4D]).integers(0, length - context, size=count)


def evenly_spaced_offsets(length: int, context: int, count: int | None = None) -> np.ndarray:
    """Start offsets of the non-overlapping windows that tile a stream (its targets each byte once), or ``count``
    of them spread evenly over it.

    Args:
        length: the stream's bytes.
        context: the model's input length; consecutive windows start ``context`` bytes apart.
        count: how many windows; None: all.

    Raises:
        ValueError: where the stream is shorter than a window, or ``count`` is not positive.
    """
    _check_window(length, context)
    if count is not None and count < 1:
        raise ValueError(f"the number of validation windows must be positive, got {count}")
    offsets = np.arange(0, length - context, context)
    if count is None or count >= len(offsets):
        return offsets
    return offsets[np.linspace(0, len(offsets) - 1, count).round().astype(np.int64)]


def _check_window(length: int, context: int) -> None:
    if context < 1:
        raise ValueError(f"the context must be at least 1 byte, got {context}")
    if length < context + 1:
        raise ValueError(f"a stream of {length} bytes is shorter than one window of context + 1 = {context + 1} bytes")


class ByteWindows(Dataset):
    """Windows of ``context + 1`` bytes of a stream: item ``i`` is ``(x, y)``, the window at ``offsets[i]`` less its
    last byte and less its first (``y[t]`` is the byte after ``x[t]``), int64 tensors of ``context`` each.

    Args:
        stream: the bytes, a uint8 array.
        context: the model's input length.
        offsets: each window's first byte in ``stream``.

    Raises:
        ValueError: where a window would run past the stream's end.
    """

    def __init__(self, stream: np.ndarray, context: int, offsets: np.ndarray) -> None:
        if len(offsets) and int(np.max(offsets)) + context + 1 > len(stream):
            raise ValueError(f"a window of {context + 1} bytes at {int(np.max(offsets))} runs past the stream's "
                             f"{len(stream)} bytes")
        self.stream = stream
        self.context = context
        self.offsets = np.asarray(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.offsets[index])
        window = torch.from_numpy(self.stream[start:start + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]


class FortunesDataModule(pl.LightningDataModule):
    """The fortunes corpus as windows of bytes: random windows of the training documents, and the validation
    documents' tiling windows for validation and test (the split's held-out documents; there is no third split).

    The windows are drawn once, with ``seed``, the same on every rank; Lightning's distributed sampler gives each
    worker its share and a new order each epoch.

    Args:
        data_dir: the folder holding the corpus's files.
        context: the model's input length in bytes.
        batch_size: windows per batch, per worker.
        train_windows: training windows per epoch; None: the training stream's bytes divided by ``context`` (each
            byte about once an epoch).
        val_windows: validate and test on this many windows, spread over the validation stream; None: all.
        seed: seeds the training windows' offsets.
    """

    def __init__(self, data_dir: str | os.PathLike[str] = FORTUNES_DIR, context: int = 128, batch_size: int = 32,
                 train_windows: int | None = None, val_windows: int | None = None, seed: int = 0) -> None:
        super().__init__()
        self.data_dir = Path(data_dir).expanduser()
        self.context = context
        self.batch_size = batch_size
        self.train_windows = train_windows
        self.val_windows = val_windows
        self.seed = seed
        self.train_set: ByteWindows | None = None
        self.val_set: ByteWindows | None = None

    @override
    def prepare_data(self) -> None:
        """Check that the corpus is there (nothing is downloaded: ``apt-get install fortunes`` puts it there)."""
        find_corpus(self.data_dir)

    @override
    def setup(self, stage: str | None = None) -> None:
        """Read and split the corpus, and cut the windows (once; later calls reuse them)."""
        if self.train_set is not None and self.val_set is not None:
            return
        train, validation = split_documents(read_documents(self.data_dir))
        train_stream, val_stream = to_stream(train), to_stream(validation)
        count = self.train_windows or max(1, len(train_stream) // self.context)
        self.train_set = ByteWindows(train_stream, self.context,
                                     random_offsets(len(train_stream), self.context, count, self.seed))
        self.val_set = ByteWindows(val_stream, self.context,
                                   evenly_spaced_offsets(len(val_stream), self.context, self.val_windows))

    def _loader(self, dataset: ByteWindows | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must be called before requesting a dataloader")
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=train, num_workers=0)

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    @override
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
