"""CIFAR-10 image classification recipe: the reader, three 32x32 models and a matching data module.

Reads the *python batches* layout that torchvision downloads (``cifar-10-batches-py/`` with
``data_batch_1`` .. ``data_batch_5``, ``test_batch`` and ``batches.meta``) without torchvision.
Those files are pickles, and a pickle can run arbitrary code when loaded, so they are read with a
restricted unpickler that only rebuilds numpy arrays, lists, dicts, ints and bytes.

The models are the three used for CIFAR-10 in the parameter-server experiments this project
reproduces: a small CNN (the Keras ``cifar10_cnn`` example), an AlexNet scaled to 32x32 inputs
and the usual CIFAR variant of ResNet-18.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plug_asgd.recipes.data import Arrays, ImageClassifier, SplitDataModule, add_common_data_arguments
from plug_asgd.recipes.idx import DatasetNotFoundError

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct

__all__ = [
    "ARCHS",
    "CIFAR10_CLASSES",
    "CIFAR10_FOLDER",
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "CIFAR10_URL",
    "DEFAULT_DATA_DIR",
    "TEST_BATCH",
    "TRAIN_BATCHES",
    "AlexNetCifar",
    "Cifar10Classifier",
    "Cifar10DataModule",
    "Cifar10FormatError",
    "DatasetNotFoundError",
    "ResNet18Cifar",
    "SmallCNN",
    "add_data_arguments",
    "build_model",
    "download_cifar10",
    "ensure_cifar10",
    "find_cifar10",
    "load_cifar10",
    "normalize",
    "random_crop_flip",
    "read_cifar10_batch",
    "read_cifar10_meta",
]

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_FOLDER = "cifar-10-batches-py"
TRAIN_BATCHES: tuple[str, ...] = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
META_FILE = "batches.meta"
CIFAR10_CLASSES: tuple[str, ...] = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)

# Per-channel mean / std of the training images scaled to [0, 1] (the values every CIFAR recipe uses).
CIFAR10_MEAN: tuple[float, float, float] = (0.4914, 0.4822, 0.4465)
CIFAR10_STD: tuple[float, float, float] = (0.2470, 0.2435, 0.2616)

DEFAULT_DATA_DIR = "~/.cache/plug_asgd/cifar10"
DOWNLOAD_TIMEOUT = 15.0

_PIXELS = 32 * 32
_ROW = 3 * _PIXELS


class Cifar10FormatError(ValueError):
    """A batch file is damaged, truncated, or does not hold CIFAR-10 images and labels."""


# ----------------------------------------------------------------------------------------- reading


class _Refused(pickle.UnpicklingError):
    """Raised inside the unpickler for anything a CIFAR-10 batch never contains."""


def _encode(obj: str, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as numpy pickles use it under protocol 2 (bytes as latin-1 text), and nothing else."""
    if not isinstance(obj, str) or codecs.lookup(encoding).name != "iso8859-1" or errors != "strict":
        raise _Refused(f"refusing _codecs.encode({type(obj).__name__}, {encoding!r}, {errors!r}): "
                       "a CIFAR-10 batch only encodes text as latin-1")
    return codecs.encode(obj, "latin1")


def _dtype(*args: Any) -> np.dtype:
    """``numpy.dtype`` for the unpickler, refusing object dtypes (arrays of arbitrary Python objects)."""
    dt = np.dtype(*args)
    if dt.hasobject:
        raise _Refused(f"refusing numpy dtype {dt}: a CIFAR-10 batch holds no object arrays")
    return dt


# (module, name) -> what the unpickler may build; everything else in a pickle is refused.
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _np_reconstruct,  # written by numpy 1.x (the original files)
    ("numpy._core.multiarray", "_reconstruct"): _np_reconstruct,  # written by numpy 2.x
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _encode,  # bytes under protocol 2 from Python 3
}


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that rebuilds numpy arrays and plain containers, and refuses every other class.

    A pickle names the callables it wants called while loading (``os.system`` for an attack);
    :meth:`find_class` is where they are looked up, so refusing there means nothing else can run.
    """

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(
                f"refusing to load {module}.{name}: a CIFAR-10 batch only holds numpy arrays, lists, "
                "ints and bytes, so this file is not a CIFAR-10 batch (or has been tampered with)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("refusing a persistent id: a CIFAR-10 batch has none")


def _unpickle(path: Path) -> Any:
    """Load ``path`` with :class:`_RestrictedUnpickler`, turning any failure into an error naming the file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise Cifar10FormatError(f"{path}: cannot read ({e})") from e
    try:
        return _RestrictedUnpickler(io.BytesIO(data), path).load()
    except _Refused as e:
        raise pickle.UnpicklingError(f"{path}: {e}") from None
    except Exception as e:  # EOFError, UnpicklingError, ValueError, TypeError... from garbled opcodes
        raise Cifar10FormatError(
            f"{path}: not a readable CIFAR-10 batch ({type(e).__name__}: {e}); the file is damaged or "
            f"truncated: delete it and download {CIFAR10_URL} again"
        ) from e


def read_cifar10_batch(path: str | os.PathLike[str]) -> tuple[np.ndarray, np.ndarray]:
    """Read one batch file into ``(images, labels)``: uint8 [N, 3, 32, 32] (channels R, G, B) and int64 [N].

    Each row of the file's ``data`` is the 1024 red, then 1024 green, then 1024 blue values of a
    32x32 image, each plane row-major, so a reshape to [N, 3, 32, 32] is the CHW layout torch uses.
    """
    path = Path(path)
    batch = _unpickle(path)
    if not isinstance(batch, dict):
        raise Cifar10FormatError(f"{path}: expected a dict with b'data' and b'labels', got {type(batch).__name__}")
    missing = [k for k in (b"data", b"labels") if k not in batch]
    if missing:
        raise Cifar10FormatError(f"{path}: missing key(s) {', '.join(map(repr, missing))}; keys are "
                                 f"{sorted(map(repr, batch))}")
    data, labels = batch[b"data"], batch[b"labels"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != _ROW:
        what = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise Cifar10FormatError(f"{path}: b'data' must be a uint8 array [N, {_ROW}], got {what}")
    if isinstance(labels, np.ndarray):
        y = labels
    elif isinstance(labels, list | tuple) and all(type(v) is int for v in labels):
        y = np.asarray(labels, dtype=np.int64) if labels else np.zeros(0, dtype=np.int64)
    else:
        raise Cifar10FormatError(f"{path}: b'labels' must be a list of ints, got {type(labels).__name__}")
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise Cifar10FormatError(f"{path}: b'labels' must be 1-D integers, got {y.dtype} {y.shape}")
    if len(y) != len(data):
        raise Cifar10FormatError(f"{path}: {len(data)} images but {len(y)} labels")
    if y.size and (y.min() < 0 or y.max() > 9):
        raise Cifar10FormatError(f"{path}: labels must be in 0..9, found {int(y.min())}..{int(y.max())}")
    images = np.ascontiguousarray(data).reshape(len(data), 3, 32, 32)
    return images, y.astype(np.int64)


def read_cifar10_meta(folder: str | os.PathLike[str]) -> list[str]:
    """The class names from ``batches.meta`` (b'label_names'), in label order."""
    path = Path(folder) / META_FILE
    meta = _unpickle(path)
    names = meta.get(b"label_names") if isinstance(meta, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, bytes | str) for n in names):
        raise Cifar10FormatError(f"{path}: expected a dict with b'label_names', a list of names")
    return [n.decode() if isinstance(n, bytes) else n for n in names]


# ----------------------------------------------------------------------------- finding, downloading


def _required() -> tuple[str, ...]:
    return (*TRAIN_BATCHES, TEST_BATCH)


def find_cifar10(data_dir: str | os.PathLike[str]) -> Path | None:
    """The ``cifar-10-batches-py`` folder at ``data_dir`` itself or just under it, or None if neither is complete."""
    root = Path(data_dir).expanduser()
    for folder in (root, root / CIFAR10_FOLDER):
        if all((folder / name).is_file() for name in _required()):
            return folder
    return None


def _how_to_get(root: Path) -> str:
    parent = root.parent if root.name == CIFAR10_FOLDER else root
    return (f"download {CIFAR10_URL} and extract it into {parent} (it unpacks to {CIFAR10_FOLDER}/), "
            f"or pass --data-dir to a folder holding {CIFAR10_FOLDER}/ or its files")


def _not_found(root: Path, why: str) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"CIFAR-10 not found in {root} (looked for data_batch_1..5 and "
        f"{TEST_BATCH} in {root} and in {root / CIFAR10_FOLDER}) and {why}; {_how_to_get(root)}"
    )


class _UnsafeArchiveError(ValueError):
    """An archive member would land outside the extraction folder, or is not a plain file/folder."""


def _safe_members(tar: tarfile.TarFile, dest: Path) -> list[tarfile.TarInfo]:
    """The members of ``tar``, refusing absolute paths, '..', links and devices."""
    dest = dest.resolve()
    members = tar.getmembers()
    for m in members:
        p = PurePosixPath(m.name)
        if m.name.startswith(("/", "\\")) or p.is_absolute() or ".." in p.parts or ":" in p.parts[0]:
            raise _UnsafeArchiveError(f"archive member {m.name!r} has an absolute path or '..'; refusing to extract")
        if not (m.isfile() or m.isdir()):
            raise _UnsafeArchiveError(f"archive member {m.name!r} is a link or special file; refusing to extract")
        if not (dest / m.name).resolve().is_relative_to(dest):
            raise _UnsafeArchiveError(f"archive member {m.name!r} points outside {dest}; refusing to extract")
    return members


def _extract(archive: Path, staging: Path) -> None:
    with tarfile.open(archive, "r:gz") as tar:
        members = _safe_members(tar, staging)
        kwargs: dict[str, Any] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(staging, members=members, **kwargs)


def download_cifar10(data_dir: str | os.PathLike[str], timeout: float = DOWNLOAD_TIMEOUT,
                     url: str | None = None) -> Path:
    """Download the standard archive and extract ``cifar-10-batches-py/`` into ``data_dir``; return that folder.

    If ``data_dir`` is itself named ``cifar-10-batches-py`` the archive is extracted next to it, so the
    files land in it. The archive is extracted into a staging folder first (refusing members with
    absolute paths, '..' or links) and its files then moved into place, so a failed download leaves
    nothing half-written behind. Raises :class:`DatasetNotFoundError` if anything fails.
    """
    root = Path(data_dir).expanduser()
    url = url or CIFAR10_URL
    parent = root.parent if root.name == CIFAR10_FOLDER else root
    target = parent / CIFAR10_FOLDER
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _not_found(root, f"the folder cannot be created ({e})") from e
    staging = Path(tempfile.mkdtemp(prefix=".cifar10-download.", dir=parent))
    try:
        archive = staging / "cifar-10-python.tar.gz"
        with open(archive, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            shutil.copyfileobj(resp, out)
        extracted = staging / "extracted"
        extracted.mkdir()
        _extract(archive, extracted)
        source = extracted / CIFAR10_FOLDER
        lacking = [name for name in _required() if not (source / name).is_file()]
        if lacking:
            raise _UnsafeArchiveError(f"the archive has no {CIFAR10_FOLDER}/{lacking[0]}")
        target.mkdir(exist_ok=True)
        for f in source.iterdir():
            if f.is_file():
                os.replace(f, target / f.name)
    except (OSError, urllib.error.URLError, tarfile.TarError, EOFError, _UnsafeArchiveError) as e:
        raise _not_found(root, f"the download of {url} failed ({type(e).__name__}: {e})") from e
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
    folder = find_cifar10(root)
    if folder is None:  # pragma: no cover - only if files vanish under us
        raise _not_found(root, f"the files are still missing after downloading {url}")
    return folder


def ensure_cifar10(data_dir: str | os.PathLike[str], download: bool = True) -> Path:
    """The ``cifar-10-batches-py`` folder for ``data_dir``, downloading it if missing and allowed."""
    root = Path(data_dir).expanduser()
    folder = find_cifar10(root)
    if folder is not None:
        return folder
    if not download:
        raise _not_found(root, "download is disabled (--no-download)")
    return download_cifar10(root)


def load_cifar10(
    data_dir: str | os.PathLike[str], download: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(train_x, train_y, test_x, test_y)``: images uint8 [N, 3, 32, 32], labels int64 [N].

    ``data_dir`` may be the ``cifar-10-batches-py`` folder itself or its parent.
    """
    folder = ensure_cifar10(data_dir, download=download)
    parts = [read_cifar10_batch(folder / name) for name in TRAIN_BATCHES]
    train_x = np.concatenate([x for x, _ in parts])
    train_y = np.concatenate([y for _, y in parts])
    test_x, test_y = read_cifar10_batch(folder / TEST_BATCH)
    return train_x, train_y, test_x, test_y


# ------------------------------------------------------------------------------- transforms


def normalize(images: np.ndarray | Tensor) -> Tensor:
    """Turn uint8 images [N, 3, 32, 32] into float input normalised with :data:`CIFAR10_MEAN` / :data:`CIFAR10_STD`."""
    x = torch.as_tensor(images).float() / 255.0
    mean = torch.tensor(CIFAR10_MEAN, dtype=x.dtype).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD, dtype=x.dtype).view(1, 3, 1, 1)
    return (x - mean) / std


def random_crop_flip(images: Tensor, padding: int = 4, generator: torch.Generator | None = None) -> Tensor:
    """The standard CIFAR augmentation on a batch [B, C, H, W], in torch ops only.

    Each image is zero-padded by ``padding`` pixels on every side, cropped back to H x W at a random
    offset, and flipped left-right with probability 1/2 (torchvision's ``RandomCrop(32, padding=4)``
    followed by ``RandomHorizontalFlip()``, drawn per image).
    """
    b, c, h, w = images.shape
    padded = F.pad(images, (padding, padding, padding, padding))
    top = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    left = torch.randint(0, 2 * padding + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    rows = top[:, None] + torch.arange(h)  # [B, H]
    cols = left[:, None] + torch.arange(w)  # [B, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    return padded[torch.arange(b)[:, None, None, None], torch.arange(c)[None, :, None, None],
                  rows[:, None, :, None], cols[:, None, None, :]]


class _Collate:
    """Stack uint8 samples into a batch, augment it (training only) and normalise it."""

    def __init__(self, augment: bool) -> None:
        self.augment = augment

    def __call__(self, samples: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        x = torch.stack([s[0] for s in samples])
        y = torch.stack([s[1] for s in samples])
        if self.augment:
            x = random_crop_flip(x)
        return normalize(x), y


# ----------------------------------------------------------------------------------------- models


class SmallCNN(nn.Module):
    """The "CNN" of the CIFAR-10 experiments: the Keras ``cifar10_cnn`` example (1,250,858 parameters).

    Two blocks of two 3x3 convolutions with max-pooling and dropout, then a 512-unit dense layer,
    which holds most of the parameters, as the Keras ``mnist_cnn`` of the MNIST recipe does.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.25),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * 6 * 6, 512), nn.ReLU(), nn.Dropout(0.5), nn.Linear(512, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class AlexNetCifar(nn.Module):
    """AlexNet scaled to 32x32 inputs (23,272,266 parameters).

    AlexNet's five convolutions (64-192-384-256-256 channels) with a 3x3 stride-2 stem instead of the
    11x11 stride-4 one, and its two 4096-unit dense layers on the 256x2x2 feature map, the variant
    commonly used for CIFAR-10 in distributed-SGD work. The dense layers make it communication-heavy.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 16 -> 8
            nn.Conv2d(64, 192, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 8 -> 4
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),  # 4 -> 2
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.5), nn.Linear(256 * 2 * 2, 4096), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(4096, 4096), nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    """ResNet's two-3x3-convolution residual block, with a 1x1 projection when the shape changes."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(planes))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18Cifar(nn.Module):
    """ResNet-18 for 32x32 inputs (11,173,962 parameters): a 3x3 stride-1 stem and no max-pool.

    The standard CIFAR variant (as in He et al.'s CIFAR experiments and the common PyTorch
    reference): four stages of two BasicBlocks, 64-128-256-512 channels, global average pool.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers: list[nn.Module] = []
        in_planes = 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)]
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.linear = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.pool(self.layers(out))
        return self.linear(torch.flatten(out, 1))


ARCHS: dict[str, Callable[[], nn.Module]] = {"cnn": SmallCNN, "alexnet": AlexNetCifar, "resnet18": ResNet18Cifar}


def build_model(arch: str) -> nn.Module:
    """A fresh network for ``arch`` ("cnn", "alexnet" or "resnet18"), mapping [B, 3, 32, 32] to logits [B, 10]."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(map(repr, ARCHS))}, got {arch!r}")
    return ARCHS[arch]()


class Cifar10Classifier(ImageClassifier):
    """One of :data:`ARCHS` trained with cross-entropy, logging exactly as :class:`MnistCNN` does."""

    def __init__(self, arch: str = "cnn", lr: float | None = None, momentum: float = 0.9,
                 optimizer: str = "adam") -> None:
        super().__init__(lr, momentum, optimizer)
        self.save_hyperparameters()
        self.net = build_model(arch)


# ------------------------------------------------------------------------------------ data module


class Cifar10DataModule(SplitDataModule):
    """CIFAR-10 from the python batches, augmented for training, with optional deterministic subsets.

    Images stay uint8 in memory (150 MB for the training set per worker); each batch is augmented
    (training only) and normalised as it is collated.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        batch_size: int = 32,
        train_subset: int | None = None,
        test_subset: int | None = None,
        download: bool = True,
        augment: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(data_dir, batch_size, train_subset, test_subset, download, seed)
        self.augment = augment

    def prepare_data(self) -> None:
        """Find (or download, on one process per node) the files; arrays are loaded in :meth:`setup`."""
        ensure_cifar10(self.data_dir, download=self.download)

    def load_arrays(self) -> Arrays:
        return load_cifar10(self.data_dir, download=self.download)

    def collate(self, train: bool) -> _Collate:
        return _Collate(train and self.augment)


# ------------------------------------------------------------------------------------ entry point


def add_data_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipe's data, model and optimiser flags: the MNIST recipe's, with ``--arch`` added."""
    default_dir = Path(os.environ.get("PLUG_ASGD_CIFAR10") or DEFAULT_DATA_DIR).expanduser()
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_dir,
        help=f"folder holding {CIFAR10_FOLDER}/, or that folder itself "
        "(default: $PLUG_ASGD_CIFAR10 or %(default)s)",
    )
    parser.add_argument(
        "--arch", choices=tuple(ARCHS), default="cnn",
        help="model: cnn (Keras cifar10_cnn), alexnet (AlexNet for 32x32) or resnet18 (CIFAR ResNet-18) "
        "(default: %(default)s)",
    )
    return add_common_data_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    from plug_asgd.recipes.common import add_strategy_arguments

    prog = "plug-asgd train cifar10" if Path(sys.argv[0]).name == "plug-asgd" else None
    parser = argparse.ArgumentParser(prog=prog, description="Train a CNN, AlexNet or ResNet-18 on CIFAR-10 under "
                                                            "AsyncPSStrategy and test the central model.")
    return add_strategy_arguments(add_data_arguments(parser))


def main(argv: list[str] | None = None) -> dict | None:
    """Entry point of ``recipes/cifar10.py`` and ``plug-asgd train cifar10``."""
    from plug_asgd.recipes.common import train_and_test

    args = build_parser().parse_args(argv)
    datamodule = Cifar10DataModule(args.data_dir, batch_size=args.batch_size, train_subset=args.train_subset,
                                   test_subset=args.test_subset, download=not args.no_download, seed=args.seed)
    model = Cifar10Classifier(arch=args.arch, lr=args.lr, optimizer=args.optimizer)
    return train_and_test("cifar10", model, datamodule, args)
