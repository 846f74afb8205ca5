"""Tests for the language-model recipe: the corpus's split by document, the byte windows, the model (its size, its
causal mask), the bad-input errors, and one real run of 2 workers under asgd on Debian's fortunes."""

from __future__ import annotations

import csv
import json
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from plug_asgd.cli.training import RECIPES
from plug_asgd.recipes import lm, lm_data
from plug_asgd.recipes.lm import ByteGPT, build, build_parser, check_context
from plug_asgd.recipes.lm_data import (
    FORTUNE_FILES,
    FORTUNES_DIR,
    SEPARATOR,
    ByteWindows,
    CorpusNotFoundError,
    Document,
    FortunesDataModule,
    evenly_spaced_offsets,
    find_corpus,
    is_validation,
    random_offsets,
    read_documents,
    split_documents,
    to_stream,
)
from tests.conftest import PYTHON, skip_unless_required

# The small run of the integration test (and of tests/scripts/lm_bar_runs.py, which measured the bar): a 2-block,
# 64-wide model (118,528 parameters) on windows of 32 bytes, one epoch of 25,600 training windows: 800 steps of 32
# in one process, 400 steps of 2 x 32 under DDP, 400 steps per worker (800 updates) under asgd; held out: 512
# windows (16,384 bytes) spread over the validation documents.
LM_SMALL = ["--d-model", "64", "--layers", "2", "--heads", "4", "--context", "32", "--batch-size", "32",
            "--train-subset", "25600", "--test-subset", "512", "--warmup-steps", "20", "--quiet"]
# The bar on the held-out loss (nats per byte) of LM_SMALL under asgd with 2 workers. Measured on 2 cores shared
# with other test runs (`python tests/scripts/lm_bar_runs.py --repeats 2 --out DIR`, then `--repeats 4 --kinds asgd`):
# one process 2.4399 twice, DDP (2 processes, gloo) 2.5872 twice (both gave the same value each time), asgd 2.5618,
# 2.6070, 2.6400, 2.6904, 2.6277, 2.6657 (the workers' interleaving moves it: a spread of 0.13).
# The bar is the worst asgd run plus 0.21, about one and a half times that spread; it stays 0.44 below a unigram
# model's 3.34 (a model that learnt only the bytes' frequencies fails) and far below an untrained model's ln 256.
# Single runs have a heavier tail than those 6 showed: 2.95 on an idle machine (of 2.61, 2.95 at one commit and
# 2.74, 2.69, 2.68 at the next) and 3.03 in a fresh-clone suite run on 2 loaded cores. As the CNN's rows
# (tests/test_momentum.py, FASHION_RERUN), a run that misses the bar is run twice more and the median of its 3 decides.
LM_LOSS_BAR = 2.9
UNTRAINED_LOSS = math.log(256)  # 5.545: uniform over the bytes
UNIGRAM_ENTROPY = 3.34  # the held-out bytes' cross-entropy under the training bytes' frequencies (3.339)

HAVE_FORTUNES = all((FORTUNES_DIR / name).is_file() for name in FORTUNE_FILES)


def write_corpus(root: Path, per_file: int = 6) -> Path:
    """A folder holding every file of the corpus, each with ``per_file`` small fortunes in the files' format."""
    root.mkdir(parents=True, exist_ok=True)
    for name in FORTUNE_FILES:
        fortunes = [f"{name} says {i}:\n\tthe {i}th line of {name}.\n" for i in range(per_file)]
        (root / name).write_text("%\n".join(fortunes) + "%\n")
    return root


# ------------------------------------------------------------------------------------------ corpus and split


def test_a_file_is_read_as_its_fortunes(tmp_path):
    folder = write_corpus(tmp_path / "c", per_file=3)
    (folder / "zippy").write_bytes(b"first\nfortune\n%\n%\n  \n%\nlast, no newline")
    docs = read_documents(folder)
    assert len(docs) == 42 * 3 + 2
    zippy = [d for d in docs if d.name.startswith("zippy:")]
    assert [(d.name, d.text) for d in zippy] == [("zippy:0", b"first\nfortune\n"), ("zippy:1", b"last, no newline\n")]
    assert docs[0] == Document("art:0", b"art says 0:\n\tthe 0th line of art.\n")


def test_the_split_is_by_document_disjoint_and_deterministic(tmp_path):
    docs = read_documents(write_corpus(tmp_path / "c", per_file=40))
    train, validation = split_documents(docs)
    assert {d.name for d in train}.isdisjoint(d.name for d in validation)
    assert sorted(d.name for d in train + validation) == sorted(d.name for d in docs)
    assert 0 < len(validation) < len(docs) / 10  # about 1 in 20
    assert all(is_validation(d) for d in validation) and not any(is_validation(d) for d in train)
    # no seed: the same split again, and whatever order the documents come in (each keeps its side)
    assert split_documents(docs) == (train, validation)
    shuffled = docs[:]
    random.Random(1).shuffle(shuffled)
    again_train, again_validation = split_documents(shuffled)
    assert {d.name for d in again_validation} == {d.name for d in validation}
    assert {d.name for d in again_train} == {d.name for d in train}


def test_a_document_held_twice_is_on_one_side():
    text = b"The same fortune in two files.\n"
    first, second = Document("wisdom:3", text), Document("people:9", text)
    assert is_validation(first) == is_validation(second)


def test_the_stream_holds_each_document_then_its_separator():
    docs = [Document("a:0", b"one\n"), Document("a:1", b"two\nlines\n")]
    stream = to_stream(docs)
    assert stream.dtype == np.uint8 and stream.tobytes() == b"one\n" + SEPARATOR + b"two\nlines\n" + SEPARATOR


@pytest.mark.skipif(not HAVE_FORTUNES, reason=f"the corpus is not installed: apt-get install {lm_data.PACKAGE}")
def test_the_installed_corpus_splits_as_it_did_when_measured():
    """Debian's fortunes 1:1.99.1: the split the bar was measured on (the same on every machine with the package)."""
    train, validation = split_documents(read_documents())
    assert (len(train), len(validation)) == (14470, 747)
    assert (len(to_stream(train)), len(to_stream(validation))) == (2445861, 130815)


# -------------------------------------------------------------------------------------------------- windows


def test_a_windows_target_is_its_input_shifted_by_one():
    stream = np.frombuffer(bytes(range(200)) * 3, dtype=np.uint8)
    offsets = random_offsets(len(stream), 16, 50, seed=0)
    windows = ByteWindows(stream, 16, offsets)
    assert len(windows) == 50
    for i in range(50):
        x, y = windows[i]
        start = int(offsets[i])
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
        assert torch.equal(x[1:], y[:-1])
        assert x.tolist() == stream[start:start + 16].tolist() and int(y[-1]) == stream[start + 16]


def test_offsets_stay_inside_the_stream_and_follow_the_seed():
    offsets = random_offsets(100, 10, 10_000, seed=3)
    assert offsets.min() == 0 and offsets.max() == 89  # a window of 11 bytes at 89 ends at the stream's end
    assert np.array_equal(offsets, random_offsets(100, 10, 10_000, seed=3))
    assert not np.array_equal(offsets, random_offsets(100, 10, 10_000, seed=4))
    tiling = evenly_spaced_offsets(100, 10)
    assert tiling.tolist() == list(range(0, 90, 10))  # each target byte 1..99 once, but the last window's
    assert evenly_spaced_offsets(100, 10, 3).tolist() == [0, 40, 80]
    with pytest.raises(ValueError, match="shorter than one window of context \\+ 1 = 11 bytes"):
        random_offsets(10, 10, 1, seed=0)
    with pytest.raises(ValueError, match="validation windows must be positive"):
        evenly_spaced_offsets(100, 10, 0)


def test_the_data_module_cuts_the_split_into_windows(tmp_path):
    folder = write_corpus(tmp_path / "c", per_file=40)
    dm = FortunesDataModule(folder, context=32, batch_size=8, train_windows=100, val_windows=5, seed=1)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 100 and len(dm.val_set) == 5
    train, validation = split_documents(read_documents(folder))
    assert np.array_equal(dm.train_set.stream, to_stream(train)) and np.array_equal(dm.val_set.stream,
                                                                                   to_stream(validation))
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (8, 32)
    assert torch.equal(next(iter(dm.val_dataloader()))[0], next(iter(dm.test_dataloader()))[0])
    whole = FortunesDataModule(folder, context=32)
    whole.setup()
    assert len(whole.train_set) == len(to_stream(train)) // 32
    assert len(whole.val_set) == len(evenly_spaced_offsets(len(to_stream(validation)), 32))


# ---------------------------------------------------------------------------------------------------- model


def test_the_default_model_has_1_to_10_million_parameters():
    model = ByteGPT()
    count = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= count <= 10_000_000 and count == 1_853_568  # the figure docs/recipes.md gives
    assert model.head.weight is model.tok_emb.weight  # tied: counted once
    args = build_parser().parse_args([])
    built, _ = build(args)
    assert sum(p.numel() for p in built.parameters()) == count and built.max_context == 128


def test_logits_are_per_byte_with_the_class_second():
    model = ByteGPT(d_model=32, layers=1, heads=2, max_context=16).eval()
    x = torch.randint(0, 256, (3, 10))
    assert model(x).shape == (3, 256, 10)


def test_changing_a_later_byte_leaves_the_earlier_logits_alone():
    torch.manual_seed(0)
    model = ByteGPT(d_model=32, layers=2, heads=4, max_context=24).eval()
    x = torch.randint(0, 256, (2, 24))
    for t in (0, 7, 23):
        changed = x.clone()
        changed[:, t] = (changed[:, t] + 1) % 256
        with torch.no_grad():
            before, after = model(x), model(changed)
        torch.testing.assert_close(after[..., :t], before[..., :t], rtol=0, atol=1e-6)
        assert not torch.allclose(after[..., t], before[..., t])  # the changed byte's own position sees it


def test_the_learning_rate_warms_up_then_decays_to_a_tenth():
    model = ByteGPT(d_model=32, layers=1, heads=2, warmup_steps=10)
    assert model.lr_factor(0, 100) == pytest.approx(0.1) and model.lr_factor(9, 100) == 1.0
    assert model.lr_factor(10, 100) == 1.0 and model.lr_factor(100, 100) == pytest.approx(0.1)
    assert model.lr_factor(55, 100) == pytest.approx(0.55)
    assert model.lr_factor(10_000, math.inf) == 1.0
    assert ByteGPT(d_model=32, layers=1, heads=2, warmup_steps=0).lr_factor(0, 100) == 1.0


# ---------------------------------------------------------------------------------------------- bad input


def test_a_missing_corpus_names_the_package_and_the_setup_script(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CorpusNotFoundError) as info:
        read_documents(missing)
    message = str(info.value)
    assert f"not found in {missing} (none of its files)" in message
    assert "'fortunes'" in message and "scripts/setup.sh" in message and "apt-get install fortunes" in message
    assert str(FORTUNES_DIR) in message and "--data-dir" in message
    partial = write_corpus(tmp_path / "partial", per_file=1)
    (partial / "zippy").unlink()
    with pytest.raises(CorpusNotFoundError, match=r"\(no zippy\)"):
        find_corpus(partial)


def test_the_recipe_without_its_corpus_is_one_line_of_error(tmp_path):
    missing = tmp_path / "no-fortunes"
    with pytest.raises(SystemExit) as exc:
        lm.main(["--data-dir", str(missing), "--quiet", "--run-dir", str(tmp_path / "runs")])
    assert str(exc.value.code).startswith(f"error: the language model's corpus was not found in {missing}")
    assert "apt-get install fortunes" in exc.value.code and not (tmp_path / "runs").exists()


def test_a_context_longer_than_the_models_is_refused_before_training(tmp_path):
    with pytest.raises(SystemExit) as exc:  # before the corpus is looked for: there is none here
        lm.main(["--context", "256", "--max-context", "128", "--data-dir", str(tmp_path)])
    assert exc.value.code == ("error: --context 256 is longer than the model's maximum context of 128 bytes "
                              "(--max-context): pass --context 128 or less, or a larger --max-context")
    assert check_context(64, 128) == 128 and check_context(64, None) == 64
    with pytest.raises(ValueError, match="--context must be at least 1 byte"):
        check_context(0, None)
    model = ByteGPT(d_model=32, layers=1, heads=2, max_context=8)
    with pytest.raises(ValueError, match="an input of 9 bytes is longer than the model's maximum context of 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"d_model": 100, "heads": 3}, r"heads \(3\) must divide d_model \(100\)"),
    ({"layers": 0}, "layers must be at least 1"),
    ({"optimizer": "rmsprop"}, "optimizer must be one of sgd, nesterov, adam"),
])
def test_a_model_size_that_cannot_be_built_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ByteGPT(**kwargs)


def test_the_recipe_has_the_recipes_flags_and_its_own(monkeypatch):
    assert RECIPES["lm"][0] == "plug_asgd.recipes.lm"
    args = build_parser().parse_args(["--workers", "3", "--mode", "adacomp", "--compressor", "none", "--d-model",
                                      "128", "--layers", "3", "--heads", "4", "--context", "96"])
    assert (args.workers, args.mode, args.d_model, args.layers, args.heads, args.context) == (3, "adacomp", 128, 3,
                                                                                            4, 96)
    assert args.data_dir == FORTUNES_DIR and args.optimizer == "adam" and args.lr is None
    monkeypatch.setenv("PLUG_ASGD_FORTUNES", "/some/where")
    assert build_parser().parse_args([]).data_dir == Path("/some/where")


# ------------------------------------------------------------------------------------------------- real run


@pytest.mark.integration
@pytest.mark.timeout(560)  # one fit, or three where the first misses the bar
def test_two_workers_under_asgd_learn_the_corpus(procs, tmp_path):
    if not HAVE_FORTUNES:
        skip_unless_required(f"the corpus is not installed: apt-get install {lm_data.PACKAGE} (scripts/setup.sh)")
    def fit(i: int) -> dict:
        metrics = tmp_path / f"m{i}.json"
        code, out = procs.run([PYTHON, "recipes/lm.py", "--workers", "2", "--mode", "asgd", *LM_SMALL,
                               "--metrics-json", str(metrics), "--run-dir", str(tmp_path / f"runs{i}")], timeout=170)
        assert code == 0, out[-4000:]
        return json.loads(metrics.read_text())

    run = fit(0)
    assert run["recipe"] == "lm" and run["workers"] == 2 and run["ps_version"] == 800  # 2 workers x 400 steps
    losses = [run["test_loss"]] + ([fit(i)["test_loss"] for i in (1, 2)] if run["test_loss"] >= LM_LOSS_BAR else [])
    assert statistics.median(losses) < LM_LOSS_BAR < UNIGRAM_ENTROPY < UNTRAINED_LOSS, (losses, run)
    assert run["test_ppl"] == pytest.approx(math.exp(run["test_loss"]), rel=1e-5)
    # validation ran at the epoch's end on the same held-out windows, and logged its loss and perplexity
    with open(Path(run["log_dir"]) / "metrics.csv") as f:
        (val,) = [row for row in csv.DictReader(f) if row["val_loss"]]
    assert float(val["val_loss"]) == pytest.approx(run["test_loss"], rel=1e-5)
    assert float(val["val_ppl"]) == pytest.approx(math.exp(float(val["val_loss"])), rel=1e-5)
