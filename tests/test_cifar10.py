"""Tests for the CIFAR-10 recipe: the restricted batch reader, download, models, data module, a real run."""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from plug_asgd.recipes import cifar10, cifar10_files
from plug_asgd.recipes.cifar10 import (
    CIFAR10_FOLDER,
    TEST_BATCH,
    TRAIN_BATCHES,
    AlexNetCifar,
    Cifar10Classifier,
    Cifar10DataModule,
    Cifar10FormatError,
    ResNet18Cifar,
    SmallCNN,
    download_cifar10,
    find_cifar10,
    load_cifar10,
    normalize,
    random_crop_flip,
    read_cifar10_batch,
    read_cifar10_meta,
)
from plug_asgd.recipes.idx import DatasetNotFoundError
from tests.conftest import PYTHON

PER_BATCH = 64
NAMES = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]


def make_batch(seed: int, n: int = PER_BATCH) -> dict:
    """A batch as the original files hold it: bytes keys, uint8 data [N, 3072], a list of int labels."""
    rng = np.random.default_rng(seed)
    labels = [int(v) for v in rng.integers(0, 10, n)]
    # learnable-ish: each class has its own mean colour, plus noise
    base = (np.array(labels)[:, None] * 23 + np.arange(3)[None, :] * 40) % 200
    data = np.clip(np.repeat(base, 1024, axis=1) + rng.integers(0, 56, (n, 3072)), 0, 255).astype(np.uint8)
    return {b"batch_label": f"batch {seed}".encode(), b"labels": labels, b"data": data,
            b"filenames": [f"img_{seed}_{i}.png".encode() for i in range(n)]}


def write_pickle(path: Path, obj: object) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar(root: Path) -> Path:
    """Write a small but exact-format cifar-10-batches-py under ``root``; return the folder."""
    folder = root / CIFAR10_FOLDER
    folder.mkdir(parents=True)
    for i, name in enumerate(TRAIN_BATCHES, start=1):
        write_pickle(folder / name, make_batch(i))
    write_pickle(folder / TEST_BATCH, make_batch(0))
    write_pickle(folder / "batches.meta", {b"label_names": NAMES, b"num_cases_per_batch": PER_BATCH,
                                           b"num_vis": 3072})
    return folder


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory) -> Path:
    """A parent folder holding cifar-10-batches-py/ (5 train batches of 64 images, a test batch of 64)."""
    root = tmp_path_factory.mktemp("cifar")
    write_cifar(root)
    return root


@pytest.fixture
def folder_copy(cifar_root, tmp_path) -> Path:
    """A private, writable copy of the batches folder, for tests that damage a file."""
    dst = tmp_path / CIFAR10_FOLDER
    dst.mkdir()
    for f in (cifar_root / CIFAR10_FOLDER).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# ------------------------------------------------------------------------------------ reader


def test_read_batch_layout_is_rgb_planes_row_major(cifar_root):
    path = cifar_root / CIFAR10_FOLDER / "data_batch_2"
    raw = make_batch(2)
    x, y = read_cifar10_batch(path)
    assert x.shape == (PER_BATCH, 3, 32, 32) and x.dtype == np.uint8
    assert y.dtype == np.int64 and y.tolist() == raw[b"labels"]
    row = raw[b"data"][5]
    np.testing.assert_array_equal(x[5, 0], row[:1024].reshape(32, 32))  # red plane, row-major
    np.testing.assert_array_equal(x[5, 1], row[1024:2048].reshape(32, 32))
    np.testing.assert_array_equal(x[5, 2], row[2048:].reshape(32, 32))
    for c, h, w in ((0, 0, 1), (0, 1, 0), (1, 7, 31), (2, 31, 30)):
        assert x[5, c, h, w] == row[1024 * c + 32 * h + w]


@pytest.mark.parametrize("where", ["parent", "folder"])
def test_load_from_the_folder_or_its_parent(cifar_root, where):
    data_dir = cifar_root if where == "parent" else cifar_root / CIFAR10_FOLDER
    assert find_cifar10(data_dir) == cifar_root / CIFAR10_FOLDER
    train_x, train_y, test_x, test_y = load_cifar10(data_dir, download=False)
    assert train_x.shape == (5 * PER_BATCH, 3, 32, 32) and train_y.shape == (5 * PER_BATCH,)
    assert test_x.shape == (PER_BATCH, 3, 32, 32) and test_y.shape == (PER_BATCH,)
    # train batches in order 1..5; the test batch is its own
    np.testing.assert_array_equal(train_x[PER_BATCH].reshape(-1), make_batch(2)[b"data"][0])
    np.testing.assert_array_equal(train_y[-PER_BATCH:], make_batch(5)[b"labels"])
    np.testing.assert_array_equal(test_x[3].reshape(-1), make_batch(0)[b"data"][3])


def test_meta_label_names(cifar_root):
    assert read_cifar10_meta(cifar_root / CIFAR10_FOLDER) == [n.decode() for n in NAMES]


def test_numpy_1_module_path_of_the_original_files_is_accepted(tmp_path):
    """The real files (numpy 1.x, Python 2) name numpy.core.multiarray._reconstruct; numpy 2 writes numpy._core."""
    raw = make_batch(7, n=4)
    blob = pickle.dumps(raw, protocol=2)
    path = tmp_path / "old_batch"
    path.write_bytes(blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray"))
    assert b"numpy.core.multiarray\n_reconstruct" in path.read_bytes()
    x, y = read_cifar10_batch(path)
    np.testing.assert_array_equal(x.reshape(4, -1), raw[b"data"])


class _RunsCommand:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "data_batch_1"
    write_pickle(path, {b"data": _RunsCommand(marker), b"labels": [0]})
    with pytest.raises(pickle.UnpicklingError, match=r"data_batch_1.*refusing to load (posix|os)\.system"):
        read_cifar10_batch(path)
    assert not marker.exists()


def test_a_pickle_asking_for_any_other_class_is_refused(tmp_path):
    path = tmp_path / "test_batch"
    write_pickle(path, collections.OrderedDict(data=np.zeros((1, 3072), np.uint8), labels=[1]))
    with pytest.raises(pickle.UnpicklingError, match=r"test_batch.*refusing to load collections\.OrderedDict"):
        read_cifar10_batch(path)


def test_object_arrays_are_refused(tmp_path):
    path = tmp_path / "data_batch_3"
    write_pickle(path, {b"data": np.array([1, "x"], dtype=object), b"labels": [1]})
    with pytest.raises(pickle.UnpicklingError, match=r"data_batch_3.*object"):
        read_cifar10_batch(path)


def test_truncated_batch_is_a_clear_error(folder_copy):
    path = folder_copy / "data_batch_4"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(Cifar10FormatError, match=r"data_batch_4.*damaged or truncated"):
        load_cifar10(folder_copy, download=False)


def test_garbage_batch_is_a_clear_error(folder_copy):
    path = folder_copy / TEST_BATCH
    path.write_bytes(b"<html>404 Not Found</html>\n")
    with pytest.raises(Cifar10FormatError, match=r"test_batch.*damaged or truncated"):
        read_cifar10_batch(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({b"data": np.zeros((2, 3072), np.float32), b"labels": [0, 1]}, r"uint8 array \[N, 3072\].*float32"),
        ({b"data": np.zeros((2, 1024), np.uint8), b"labels": [0, 1]}, r"uint8 array \[N, 3072\]"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, r"2 images but 1 labels"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, r"labels must be in 0\.\.9"),
        ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, -1]}, r"labels must be in 0\.\.9"),
        ({b"data": np.zeros((2, 3072), np.uint8)}, r"missing key.*labels"),
        ([1, 2, 3], r"expected a dict"),
    ],
)
def test_wrong_content_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "data_batch_5"
    write_pickle(path, content)
    with pytest.raises(Cifar10FormatError, match=rf"data_batch_5.*{message}"):
        read_cifar10_batch(path)


# ------------------------------------------------------------------------------ find / download


def test_missing_folder_without_download(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError, match="not found") as info:
        load_cifar10(missing, download=False)
    msg = str(info.value)
    assert str(missing) in msg and str(missing / CIFAR10_FOLDER) in msg
    assert cifar10.CIFAR10_URL in msg and "--data-dir" in msg
    assert not missing.exists()  # nothing created


def test_incomplete_folder_is_not_found(folder_copy):
    (folder_copy / "data_batch_3").unlink()
    assert find_cifar10(folder_copy) is None
    assert find_cifar10(folder_copy.parent) is None
    with pytest.raises(DatasetNotFoundError, match="download is disabled"):
        Cifar10DataModule(folder_copy.parent, download=False).prepare_data()


def make_archive(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def archive_of(folder: Path) -> dict[str, bytes]:
    return {f"{CIFAR10_FOLDER}/{f.name}": f.read_bytes() for f in sorted(folder.iterdir())}


@pytest.mark.parametrize("into", ["parent", "folder"])
def test_download_extracts_the_archive(cifar_root, tmp_path, into):
    archive = make_archive(tmp_path / "cifar-10-python.tar.gz", archive_of(cifar_root / CIFAR10_FOLDER))
    data_dir = tmp_path / "data" if into == "parent" else tmp_path / "data" / CIFAR10_FOLDER
    folder = download_cifar10(data_dir, url=archive.as_uri())
    assert folder == tmp_path / "data" / CIFAR10_FOLDER
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == [CIFAR10_FOLDER]  # staging removed
    x, y, _, _ = load_cifar10(data_dir, download=False)
    assert len(x) == 5 * PER_BATCH


@pytest.mark.parametrize("evil", ["../escaped", "/tmp/absolute", f"{CIFAR10_FOLDER}/../../escaped"])
def test_download_refuses_members_outside_the_folder(cifar_root, tmp_path, evil):
    files = {**archive_of(cifar_root / CIFAR10_FOLDER), evil: b"boo"}
    archive = make_archive(tmp_path / "evil.tar.gz", files)
    data_dir = tmp_path / "a" / "b" / "data"
    with pytest.raises(DatasetNotFoundError, match=r"absolute path or '\.\.'") as info:
        download_cifar10(data_dir, url=archive.as_uri())
    assert str(data_dir) in str(info.value)
    assert not (tmp_path / "a" / "b" / "escaped").exists() and not (tmp_path / "a" / "escaped").exists()
    assert not (data_dir / CIFAR10_FOLDER).exists()
    assert list(data_dir.iterdir()) == []  # staging removed


def test_failed_download_is_dataset_not_found(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar10_files, "CIFAR10_URL", (tmp_path / "no-such-archive.tar.gz").as_uri())
    data_dir = tmp_path / "data"
    with pytest.raises(DatasetNotFoundError, match="download of .* failed") as info:
        load_cifar10(data_dir, download=True)
    assert str(data_dir) in str(info.value) and "--data-dir" in str(info.value)
    assert list(data_dir.iterdir()) == []


def test_archive_without_the_batches_is_dataset_not_found(tmp_path):
    archive = make_archive(tmp_path / "other.tar.gz", {"readme.txt": b"hello"})
    with pytest.raises(DatasetNotFoundError, match=f"no {CIFAR10_FOLDER}/data_batch_1"):
        download_cifar10(tmp_path / "data", url=archive.as_uri())


# ------------------------------------------------------------------------------------ models


@pytest.mark.parametrize("model_cls", [SmallCNN, AlexNetCifar, ResNet18Cifar])
def test_models_map_32x32_images_to_10_logits(model_cls):
    model = model_cls().eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_resnet18_has_the_standard_cifar_parameter_count():
    assert sum(p.numel() for p in ResNet18Cifar().parameters()) == 11_173_962


@pytest.mark.parametrize("arch", ["cnn", "alexnet", "resnet18"])
def test_classifier_builds_each_arch_and_rejects_others(arch):
    model = Cifar10Classifier(arch=arch, optimizer="sgd", lr=0.01)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert isinstance(model.configure_optimizers(), torch.optim.SGD)
    with pytest.raises(ValueError, match="arch"):
        Cifar10Classifier(arch="vgg")
    with pytest.raises(ValueError, match="optimizer"):
        Cifar10Classifier(optimizer="rmsprop")


# ---------------------------------------------------------------------------- transforms, data module


def test_normalize_uses_the_cifar_mean_and_std():
    x = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    out = normalize(x)
    assert out.dtype == torch.float32
    expected = [(1 - m) / s for m, s in zip(cifar10.CIFAR10_MEAN, cifar10.CIFAR10_STD, strict=True)]
    assert out[0, :, 0, 0].tolist() == pytest.approx(expected)


def test_random_crop_flip_is_a_padded_crop_maybe_flipped():
    g = torch.Generator().manual_seed(0)
    images = torch.randint(1, 256, (16, 3, 32, 32), dtype=torch.uint8)  # no zeros: padding is recognisable
    out = random_crop_flip(images, generator=g)
    assert out.shape == images.shape and out.dtype == torch.uint8
    padded = torch.nn.functional.pad(images, (4, 4, 4, 4))
    flipped = 0
    for b in range(16):
        crops = [padded[b, :, i:i + 32, j:j + 32] for i in range(9) for j in range(9)]
        if any(torch.equal(out[b], c) for c in crops):
            continue
        assert any(torch.equal(out[b], c.flip(-1)) for c in crops), f"image {b} is not a crop"
        flipped += 1
    assert 0 < flipped < 16
    assert not torch.equal(out, images)


def test_datamodule_batches_subsets_and_augmentation(cifar_root):
    dm = Cifar10DataModule(cifar_root, batch_size=32, train_subset=100, test_subset=40, download=False)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 100 and len(dm.test_set) == 40
    again = Cifar10DataModule(cifar_root / CIFAR10_FOLDER, train_subset=100, download=False)
    again.setup("fit")
    assert torch.equal(dm.train_set.tensors[0], again.train_set.tensors[0])  # same subset on every rank
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (32, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.long
    # test batches are exactly the normalised images, in order, not augmented
    tx, ty = next(iter(dm.test_dataloader()))
    assert torch.equal(tx, normalize(dm.test_set.tensors[0][:32])) and torch.equal(ty, dm.test_set.tensors[1][:32])
    vx, _ = next(iter(dm.val_dataloader()))
    assert torch.equal(vx, tx)
    # training batches are augmented unless asked not to be
    plain = Cifar10DataModule(cifar_root, batch_size=300, download=False, augment=False)
    plain.setup("fit")
    aug = Cifar10DataModule(cifar_root, batch_size=300, download=False)
    aug.setup("fit")
    torch.manual_seed(0)
    px, _ = next(iter(plain.train_dataloader()))
    torch.manual_seed(0)
    ax, _ = next(iter(aug.train_dataloader()))
    assert px.shape == ax.shape and not torch.equal(px, ax)
    with pytest.raises(ValueError, match="positive"):
        Cifar10DataModule(cifar_root, train_subset=0, download=False).setup()


def test_parser_has_the_mnist_flags_and_arch(monkeypatch):
    monkeypatch.setenv("PLUG_ASGD_CIFAR10", "/some/where")
    args = cifar10.build_parser().parse_args(["--arch", "resnet18", "--workers", "3", "--no-download"])
    assert args.arch == "resnet18" and args.workers == 3 and args.no_download
    assert args.data_dir == Path("/some/where") and args.optimizer == "adam" and args.batch_size == 32
    monkeypatch.delenv("PLUG_ASGD_CIFAR10")
    assert cifar10.build_parser().parse_args([]).data_dir == Path("~/.cache/plug_asgd/cifar10").expanduser()
    with pytest.raises(SystemExit):
        cifar10.build_parser().parse_args(["--arch", "vgg"])


# ---------------------------------------------------------------------------------- real run


def test_recipe_trains_two_workers_end_to_end(procs, cifar_root, tmp_path):
    metrics = tmp_path / "m.json"
    code, out = procs.run([PYTHON, "recipes/cifar10.py", "--workers", "2", "--mode", "asgd", "--arch", "cnn",
                           "--data-dir", str(cifar_root), "--no-download", "--quiet", "--no-val",
                           "--max-steps", "5", "--metrics-json", str(metrics), "--run-dir", str(tmp_path / "runs")],
                          timeout=150)
    assert code == 0, out[-4000:]
    run = json.loads(metrics.read_text())
    assert run["recipe"] == "cifar10" and run["workers"] == 2
    assert run["ps_version"] == 10  # 2 workers x 5 steps
    assert 0.0 <= run["test_acc"] <= 1.0


def test_recipe_without_data_fails_before_starting_workers(procs, tmp_path):
    missing = tmp_path / "no-cifar"
    code, out = procs.run([PYTHON, "recipes/cifar10.py", "--data-dir", str(missing), "--no-download", "--quiet",
                           "--run-dir", str(tmp_path / "runs")], timeout=60)
    assert code != 0
    # the launching process says it once, without a traceback, and names the folder it looked in
    assert out.count(f"CIFAR-10 not found in {missing}") == 1 and "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "runs").exists()
