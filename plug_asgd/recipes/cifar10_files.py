"""The CIFAR-10 *python batches* (``cifar-10-batches-py/``): reading them safely, finding and downloading them.

Reads the layout that torchvision downloads (``data_batch_1`` .. ``data_batch_5``, ``test_batch``
and ``batches.meta``) without torchvision. Those files are pickles, and a pickle can run arbitrary
code when loaded, so they are read with a restricted unpickler that only rebuilds numpy arrays,
lists, dicts, ints and bytes.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import os
import pickle
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from plug_asgd.recipes.idx import DatasetNotFoundError

try:  # numpy >= 2
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
except ImportError:  # pragma: no cover - numpy 1.x
    from numpy.core.multiarray import _reconstruct as _np_reconstruct

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

    Args:
        path: the batch file (``data_batch_1``, ``test_batch``...).

    Raises:
        Cifar10FormatError: where the file cannot be read or unpickled, or does not hold uint8 images and as
            many labels in 0..9.
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
    """The class names from ``batches.meta`` (b'label_names'), in label order.

    Args:
        folder: the ``cifar-10-batches-py`` folder.

    Raises:
        Cifar10FormatError: where ``batches.meta`` cannot be read, or holds no list of names.
    """
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
    """The ``cifar-10-batches-py`` folder at ``data_dir`` itself or just under it, or None if neither is complete.

    Args:
        data_dir: the folder holding ``cifar-10-batches-py/``, or that folder itself (``~`` expanded).
    """
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

    Args:
        data_dir: the folder to hold ``cifar-10-batches-py/``, or that folder itself; created if missing.
        timeout: seconds a connection may stay silent before the download fails.
        url: where the archive is downloaded from; None: :data:`CIFAR10_URL`.

    Raises:
        DatasetNotFoundError: where the folder cannot be created, the download or the extraction fails, or the
            archive lacks a batch.
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
    """The ``cifar-10-batches-py`` folder for ``data_dir``, downloading it if missing and allowed.

    Args:
        data_dir: the folder holding ``cifar-10-batches-py/``, or that folder itself.
        download: whether a missing dataset may be downloaded.

    Raises:
        DatasetNotFoundError: where the dataset is missing and ``download`` is False.
    """
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

    Args:
        data_dir: the folder holding ``cifar-10-batches-py/``, or that folder itself.
        download: whether a missing dataset may be downloaded.
    """
    folder = ensure_cifar10(data_dir, download=download)
    parts = [read_cifar10_batch(folder / name) for name in TRAIN_BATCHES]
    train_x = np.concatenate([x for x, _ in parts])
    train_y = np.concatenate([y for _, y in parts])
    test_x, test_y = read_cifar10_batch(folder / TEST_BATCH)
    return train_x, train_y, test_x, test_y
