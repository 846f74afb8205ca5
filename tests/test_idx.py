"""Tests for the IDX reader/writer, MNIST file discovery and the recipe model's shape."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from plug_asgd.recipes import idx
from plug_asgd.recipes.idx import (
    MNIST_FILES,
    DatasetNotFoundError,
    IDXFormatError,
    download_mnist,
    ensure_mnist,
    find_mnist_files,
    load_mnist,
    read_idx,
    write_idx,
)
from plug_asgd.recipes.mnist import MnistCNN

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")

DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64]


@pytest.mark.parametrize("suffix", ["", ".gz"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip(tmp_path: Path, suffix: str, dtype: type) -> None:
    rng = np.random.default_rng(0)
    arr = (rng.standard_normal((3, 4, 5)) * 50).astype(dtype)
    path = tmp_path / f"a-idx3{suffix}"
    write_idx(path, arr)
    if suffix:
        with gzip.open(path) as f:  # really gzip'd
            f.read(1)
    out = read_idx(path)
    assert out.shape == arr.shape
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, arr)


def test_roundtrip_1d_and_big_endian_layout(tmp_path: Path) -> None:
    arr = np.array([1, -2, 300], dtype=np.int32)
    path = tmp_path / "labels-idx1"
    write_idx(path, arr)
    raw = path.read_bytes()
    assert raw[:4] == bytes([0, 0, 0x0C, 1])
    assert raw[4:8] == (3).to_bytes(4, "big")
    assert raw[8:12] == (1).to_bytes(4, "big")  # values are big-endian too
    np.testing.assert_array_equal(read_idx(path), arr)


def test_bad_magic(tmp_path: Path) -> None:
    path = tmp_path / "bad-magic-idx1"
    path.write_bytes(b"\x01\x02\x08\x01" + (2).to_bytes(4, "big") + b"\x00\x00")
    with pytest.raises(IDXFormatError, match=r"bad-magic-idx1.*magic"):
        read_idx(path)


def test_unknown_dtype(tmp_path: Path) -> None:
    path = tmp_path / "bad-type-idx1"
    path.write_bytes(b"\x00\x00\x07\x01" + (1).to_bytes(4, "big") + b"\x00")
    with pytest.raises(IDXFormatError, match=r"bad-type-idx1.*0x07"):
        read_idx(path)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_truncated(tmp_path: Path, suffix: str) -> None:
    full = tmp_path / "full-idx3"
    write_idx(full, np.zeros((4, 28, 28), dtype=np.uint8))
    data = full.read_bytes()[:-10]
    path = tmp_path / f"short-idx3{suffix}"
    path.write_bytes(gzip.compress(data) if suffix else data)
    with pytest.raises(IDXFormatError, match=rf"short-idx3{suffix}.*truncated"):
        read_idx(path)


def test_truncated_gzip_stream(tmp_path: Path) -> None:
    path = tmp_path / "cut-idx1.gz"
    write_idx(path, np.arange(1000, dtype=np.uint8) % 10)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(IDXFormatError, match=r"cut-idx1\.gz"):
        read_idx(path)


def _write_fake_mnist(folder: Path, n_train: int = 6, n_test: int = 4, gz: bool = True, **over: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train).astype(np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test).astype(np.uint8),
    }
    for key, arr in arrays.items():
        name = over.get(key, MNIST_FILES[key] + (".gz" if gz else ""))
        write_idx(folder / name, arr)


def test_find_torchvision_layout(tmp_path: Path) -> None:
    assert find_mnist_files(tmp_path) is None
    raw = tmp_path / "MNIST" / "raw"
    _write_fake_mnist(raw, gz=False)
    found = find_mnist_files(tmp_path)
    assert found is not None
    assert found == {k: raw / v for k, v in MNIST_FILES.items()}


def test_find_dot_spelling_and_load(tmp_path: Path) -> None:
    _write_fake_mnist(tmp_path, train_images="train-images.idx3-ubyte.gz")
    found = find_mnist_files(tmp_path)
    assert found is not None and found["train_images"].name == "train-images.idx3-ubyte.gz"
    tx, ty, vx, vy = load_mnist(tmp_path, download=False)
    assert tx.shape == (6, 28, 28) and tx.dtype == np.uint8
    assert ty.shape == (6,) and ty.dtype == np.int64
    assert vx.shape == (4, 28, 28) and vy.dtype == np.int64


def test_find_missing_one_file(tmp_path: Path) -> None:
    _write_fake_mnist(tmp_path)
    (tmp_path / (MNIST_FILES["test_labels"] + ".gz")).unlink()
    assert find_mnist_files(tmp_path) is None


def test_label_count_mismatch(tmp_path: Path) -> None:
    _write_fake_mnist(tmp_path)
    write_idx(tmp_path / (MNIST_FILES["train_labels"] + ".gz"), np.zeros(5, dtype=np.uint8))
    with pytest.raises(IDXFormatError, match=r"6 images but .* 5 labels"):
        load_mnist(tmp_path, download=False)


def test_prepare_data_finds_the_files_without_reading_them(tmp_path: Path) -> None:
    from plug_asgd.recipes.mnist import MnistDataModule

    _write_fake_mnist(tmp_path)
    write_idx(tmp_path / (MNIST_FILES["train_labels"] + ".gz"), np.zeros(5, dtype=np.uint8))  # 6 images, 5 labels
    assert ensure_mnist(tmp_path, download=False) == {k: tmp_path / (v + ".gz") for k, v in MNIST_FILES.items()}
    dm = MnistDataModule(tmp_path, download=False)
    dm.prepare_data()  # finds the four files; reading them is setup's work, on every process
    with pytest.raises(IDXFormatError, match=r"6 images but .* 5 labels"):
        dm.setup("fit")
    with pytest.raises(DatasetNotFoundError, match="download is disabled"):
        MnistDataModule(tmp_path / "empty", download=False).prepare_data()


def test_missing_without_download(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        load_mnist(tmp_path, download=False)
    msg = str(info.value)
    assert str(tmp_path) in msg
    assert "dataset-fashion-mnist" in msg
    assert "--data-dir" in msg
    assert isinstance(info.value, FileNotFoundError)


def test_download_falls_back_to_next_mirror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = tmp_path / "mirror"
    _write_fake_mnist(mirror)
    (mirror / "junk").mkdir()
    # A "mirror" serving garbage for one file: it must be rejected, not saved.
    (mirror / "junk" / (MNIST_FILES["train_images"] + ".gz")).write_bytes(gzip.compress(b"<html>"))
    missing = (tmp_path / "nowhere").as_uri() + "/"
    monkeypatch.setattr(
        idx, "MNIST_MIRRORS", (missing, (mirror / "junk").as_uri() + "/", mirror.as_uri() + "/")
    )
    dest = tmp_path / "data"
    found = download_mnist(dest, timeout=1.0)
    assert found == {k: dest / (v + ".gz") for k, v in MNIST_FILES.items()}
    assert sorted(p.name for p in dest.iterdir()) == sorted(v + ".gz" for v in MNIST_FILES.values())
    assert load_mnist(dest, download=False)[0].shape == (6, 28, 28)


def test_download_failure_leaves_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idx, "MNIST_MIRRORS", ((tmp_path / "nowhere").as_uri() + "/",))
    dest = tmp_path / "data"
    with pytest.raises(DatasetNotFoundError) as info:
        load_mnist(dest, download=True)
    msg = str(info.value)
    assert str(dest) in msg and "dataset-fashion-mnist" in msg and "nowhere" in msg
    assert list(dest.iterdir()) == []


@pytest.mark.skipif(
    not FASHION_DIR.is_dir(), reason=f"{FASHION_DIR} missing (apt-get install dataset-fashion-mnist)"
)
def test_real_fashion_mnist() -> None:
    tx, ty, vx, vy = load_mnist(FASHION_DIR, download=False)
    assert tx.shape == (60000, 28, 28) and tx.dtype == np.uint8
    assert vx.shape == (10000, 28, 28) and vx.dtype == np.uint8
    assert ty.shape == (60000,) and vy.shape == (10000,)
    assert ty.min() == 0 and ty.max() == 9 and vy.min() == 0 and vy.max() == 9
    assert np.bincount(ty, minlength=10).tolist() == [6000] * 10


def test_cnn_parameter_count_and_shape() -> None:
    # conv1: 1*32*3*3 + 32 = 320; conv2: 32*64*3*3 + 64 = 18496;
    # dense: 9216*128 + 128 = 1179776 (9216 = 64 * 12 * 12); out: 128*10 + 10 = 1290.
    # 320 + 18496 + 1179776 + 1290 = 1199882.
    model = MnistCNN()
    assert sum(p.numel() for p in model.parameters()) == 1_199_882
    model.eval()
    with torch.no_grad():
        out = model(torch.randn(2, 1, 28, 28))
    assert out.shape == (2, 10)
