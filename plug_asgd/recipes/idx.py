"""Reading, writing and locating IDX files (the MNIST / Fashion-MNIST format).

Kept free of torchvision so the recipes run in a minimal environment: the IDX format is
simple enough to parse with numpy, and doing it here lets us give precise errors when a
file is missing or damaged instead of a deep stack trace from a third-party loader.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
import struct
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO

import numpy as np

__all__ = [
    "MNIST_FILES",
    "MNIST_MIRRORS",
    "DatasetNotFoundError",
    "IDXFormatError",
    "download_mnist",
    "ensure_mnist",
    "find_mnist_files",
    "load_mnist",
    "read_idx",
    "write_idx",
]

# IDX type code -> numpy dtype (multi-byte types are big-endian in the file).
_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_CODES: dict[tuple[str, int], int] = {(dt.kind, dt.itemsize): code for code, dt in _DTYPES.items()}

MNIST_FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}

# Same mirrors, in the same order, as torchvision.datasets.MNIST.
MNIST_MIRRORS: tuple[str, ...] = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)

_HOW_TO_GET_DATA = (
    "download MNIST's four IDX files into {dir}, or pass --data-dir to a folder holding them; "
    "on Debian `apt-get install dataset-fashion-mnist` installs Fashion-MNIST (a drop-in replacement) "
    "under /usr/share/datasets/fashion-mnist"
)


class IDXFormatError(ValueError):
    """A file is not a valid IDX file (bad magic, unknown type code, or wrong size)."""


class DatasetNotFoundError(FileNotFoundError):
    """The dataset is not on disk and could not (or may not) be downloaded."""


def _open(path: Path, mode: str) -> IO[bytes]:
    """Open ``path`` transparently through gzip when its name ends with ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, mode)  # type: ignore[return-value]
    return open(path, mode)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (raw or gzip'd) into a native-endian numpy array.

    Checks the header against the payload so a truncated download fails loudly here rather
    than producing a silently short dataset.

    Args:
        path: the file; read through gzip where its name ends with ``.gz``.

    Raises:
        IDXFormatError: where the file cannot be decompressed, or its header or size is not an IDX file's.
    """
    path = Path(path)
    try:
        with _open(path, "rb") as f:
            data = f.read()
    except (gzip.BadGzipFile, EOFError) as e:
        raise IDXFormatError(f"{path.name}: cannot decompress ({e}); the file is damaged or truncated") from e
    if len(data) < 4:
        raise IDXFormatError(f"{path.name}: file is {len(data)} bytes, too short for an IDX header")
    zero1, zero2, code, ndim = data[0], data[1], data[2], data[3]
    if zero1 != 0 or zero2 != 0:
        raise IDXFormatError(
            f"{path.name}: bad magic {data[:4].hex()} (an IDX file starts with two zero bytes); "
            "not an IDX file?"
        )
    if code not in _DTYPES:
        raise IDXFormatError(
            f"{path.name}: unknown IDX type code 0x{code:02X} (known: "
            + ", ".join(f"0x{c:02X}" for c in _DTYPES)
            + ")"
        )
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise IDXFormatError(
            f"{path.name}: truncated header: {ndim} dimensions need {header_len} bytes, file has {len(data)}"
        )
    dims = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = _DTYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header_len
    if actual != expected:
        what = "truncated" if actual < expected else "has trailing bytes"
        raise IDXFormatError(
            f"{path.name}: data {what}: header dims {tuple(dims)} of {dtype.name} need {expected} bytes, "
            f"found {actual}"
        )
    arr = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """Write ``array`` as IDX (gzip'd if the name ends with ``.gz``); the inverse of :func:`read_idx`.

    Args:
        path: the file written (replaced if it exists).
        array: the values, of a dtype IDX stores (uint8, int8, int16, int32, float32, float64).

    Raises:
        TypeError: where IDX cannot store ``array``'s dtype.
        ValueError: where ``array`` has more than 255 dimensions.
    """
    path = Path(path)
    array = np.asarray(array)
    key = (array.dtype.kind, array.dtype.itemsize)
    if key not in _CODES:
        raise TypeError(
            f"IDX cannot store dtype {array.dtype}; use one of " + ", ".join(str(d) for d in _DTYPES.values())
        )
    code = _CODES[key]
    if array.ndim > 255:
        raise ValueError(f"IDX supports at most 255 dimensions, got {array.ndim}")
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = np.ascontiguousarray(array, dtype=_DTYPES[code]).tobytes()
    with _open(path, "wb") as f:
        f.write(header)
        f.write(payload)


def _candidates(name: str) -> list[str]:
    """File names under which ``name`` may be stored (plain/gzip, new/old dot spelling)."""
    # The original distribution spelled e.g. "train-images.idx3-ubyte"; newer copies use a hyphen.
    dotted = name.replace("-idx", ".idx", 1)
    names = [name, name + ".gz"]
    if dotted != name:
        names += [dotted, dotted + ".gz"]
    return names


def find_mnist_files(data_dir: str | os.PathLike[str]) -> dict[str, Path] | None:
    """Locate the four MNIST IDX files under ``data_dir``, or return None if any is missing.

    Also looks in ``data_dir/MNIST/raw`` and ``data_dir/raw`` so an existing torchvision
    download can be reused without copying.

    Args:
        data_dir: the folder looked in (``~`` expanded).
    """
    root = Path(data_dir).expanduser()
    dirs = [root, root / "MNIST" / "raw", root / "raw"]
    found: dict[str, Path] = {}
    for key, name in MNIST_FILES.items():
        for d in dirs:
            hit = next((d / c for c in _candidates(name) if (d / c).is_file()), None)
            if hit is not None:
                found[key] = hit
                break
        else:
            return None
    return found


def _fetch(url: str, dest: Path, timeout: float) -> None:
    """Download ``url`` to ``dest`` atomically, checking it parses as IDX before it gets its final name.

    Goes through a temp file in the same directory and ``os.replace`` so an interrupted or
    garbage download (e.g. an HTML error page) never leaves a file that ``find_mnist_files``
    would later pick up.
    """
    # The ".gz" suffix makes read_idx decompress the temp file for validation.
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part.gz", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            shutil.copyfileobj(resp, out)
        read_idx(tmp)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def download_mnist(data_dir: str | os.PathLike[str], timeout: float = 15.0) -> dict[str, Path]:
    """Download the four MNIST files into ``data_dir`` from the mirrors torchvision uses.

    Files already present are kept. Raises :class:`DatasetNotFoundError` with instructions for
    getting the data by hand when no mirror works (e.g. on a machine without internet).

    Args:
        data_dir: the folder the files are downloaded into; created if missing.
        timeout: seconds a connection may stay silent before that mirror fails.

    Raises:
        DatasetNotFoundError: where the folder cannot be created or no mirror serves a file.
    """
    root = Path(data_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatasetNotFoundError(
            f"MNIST not found in {root} and the directory cannot be created ({e}); "
            + _HOW_TO_GET_DATA.format(dir=root)
        ) from e
    existing = find_mnist_files(root) or {}
    for key, name in MNIST_FILES.items():
        if key in existing:
            continue
        dest = root / (name + ".gz")
        errors: list[str] = []
        for mirror in MNIST_MIRRORS:
            url = mirror + name + ".gz"
            try:
                _fetch(url, dest, timeout)
                break
            except (OSError, urllib.error.URLError, IDXFormatError) as e:
                errors.append(f"{url}: {e}")
        else:
            raise DatasetNotFoundError(
                f"MNIST not found in {root} and download failed ({'; '.join(errors)}); "
                + _HOW_TO_GET_DATA.format(dir=root)
            )
    found = find_mnist_files(root)
    if found is None:  # pragma: no cover - only if files vanish under us
        raise DatasetNotFoundError(
            f"MNIST files missing from {root} after download; " + _HOW_TO_GET_DATA.format(dir=root)
        )
    return found


def ensure_mnist(data_dir: str | os.PathLike[str], download: bool = True) -> dict[str, Path]:
    """The four IDX files for ``data_dir``, downloaded if missing and allowed; nothing is read.

    Args:
        data_dir: the folder holding the files (or ``MNIST/raw`` or ``raw`` under it).
        download: whether missing files may be downloaded.

    Raises:
        DatasetNotFoundError: where a file is missing and ``download`` is False.
    """
    root = Path(data_dir).expanduser()
    files = find_mnist_files(root)
    if files is not None:
        return files
    if not download:
        raise DatasetNotFoundError(
            f"MNIST not found in {root} (looked in {root}, {root / 'MNIST' / 'raw'} and {root / 'raw'}) "
            "and download is disabled; " + _HOW_TO_GET_DATA.format(dir=root)
        )
    return download_mnist(root)


def load_mnist(
    data_dir: str | os.PathLike[str], download: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(train_x, train_y, test_x, test_y)`` with images uint8 [N, 28, 28] and labels int64.

    Finds the files under ``data_dir`` (downloading them if allowed) and checks that images and
    labels agree, so a mismatched pair of files is caught before training starts.

    Args:
        data_dir: the folder holding the files (or ``MNIST/raw`` or ``raw`` under it).
        download: whether missing files may be downloaded.

    Raises:
        IDXFormatError: where the images are not uint8 [N, H, W], the labels not 1-D, or their numbers differ.
    """
    files = ensure_mnist(data_dir, download=download)
    out: list[np.ndarray] = []
    for split in ("train", "test"):
        x = read_idx(files[f"{split}_images"])
        y = read_idx(files[f"{split}_labels"])
        if x.ndim != 3 or x.dtype != np.uint8:
            raise IDXFormatError(
                f"{files[f'{split}_images'].name}: expected uint8 images [N, H, W], got {x.dtype} {x.shape}"
            )
        if y.ndim != 1:
            raise IDXFormatError(f"{files[f'{split}_labels'].name}: expected 1-D labels, got shape {y.shape}")
        if len(x) != len(y):
            raise IDXFormatError(
                f"{split} split mismatch: {files[f'{split}_images'].name} has {len(x)} images but "
                f"{files[f'{split}_labels'].name} has {len(y)} labels"
            )
        out += [x, y.astype(np.int64)]
    return out[0], out[1], out[2], out[3]
