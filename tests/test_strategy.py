"""AsyncPSStrategy in this process: one worker, an embedded PS, and what evaluation and checkpoints see."""

from __future__ import annotations

import gc
import logging
import time
import warnings
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ReduceOp
from torch.utils.data import DataLoader, TensorDataset

from plug_asgd import AsyncPSStrategy
from plug_asgd.compressors import RandomK
from plug_asgd.modes import AGN, EASGD, OSP, SSP, AdaComp, Asgd, Downpour, Sync
from plug_asgd.strategy import synced_tensors
from plug_asgd.worker.client import PSClient, PSError, PSUnreachableError
from plug_asgd.worker.collectives import op_name
from plug_asgd.worker.staging import Staging
from tests.conftest import free_port, group_members


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layer(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def data(n: int = 320) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)


def central(strategy: AsyncPSStrategy) -> dict[str, np.ndarray]:
    return strategy.connection.client.pull().tensors


class Probe(pl.Callback):
    """Records, at chosen moments, the local weights next to the PS's."""

    def __init__(self, save_to) -> None:
        self.save_to = save_to
        self.seen: dict[str, object] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == 6 and "ckpt" not in self.seen:  # 7 local steps: pushed at 5, 2 not yet pushed
            trainer.save_checkpoint(self.save_to)
            self.seen["ckpt"] = (central(trainer.strategy), module.layer.weight.detach().clone(),
                                 trainer.strategy._exchange.version)

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if "val" not in self.seen:
            self.seen["val"] = (central(trainer.strategy), module.layer.weight.detach().clone(),
                                trainer.strategy._exchange.version)


@pytest.fixture
def strategy():
    s = AsyncPSStrategy(mode=Asgd(push_every=5))
    yield s
    proc = s.connection.embedded.process
    s._shutdown(wait_for_workers=0)
    if proc is not None:
        assert proc.poll() is not None and not group_members(proc.pid)


@pytest.mark.integration
def test_checkpoints_and_validation_see_the_central_model(strategy, tmp_path):
    probe = Probe(tmp_path / "mid.ckpt")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, val_check_interval=12,
                         num_sanity_val_steps=0, callbacks=[probe], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data(), data(64))
    ps_weights, local, version = probe.seen["ckpt"]
    assert version == 1  # one push (after step 5); steps 6 and 7 are only local
    assert not torch.equal(local, torch.from_numpy(ps_weights["layer.weight"]))
    saved = torch.load(tmp_path / "mid.ckpt", weights_only=True)["state_dict"]
    np.testing.assert_array_equal(saved["layer.weight"].numpy(), ps_weights["layer.weight"])
    # validation after 12 steps: 10 pushed in two pushes, the 2 pending flushed, then the central pulled
    ps_weights, local, version = probe.seen["val"]
    assert version == 3
    np.testing.assert_array_equal(local.numpy(), ps_weights["layer.weight"])
    # fit leaves the module holding the final central model: 20 steps = 4 pushes + 1 at validation
    assert strategy._exchange.version == 5
    np.testing.assert_array_equal(trainer.lightning_module.layer.weight.detach().numpy(),
                                  central(strategy)["layer.weight"])


@pytest.mark.integration
def test_a_lone_asgd_worker_gets_no_model_back_yet_holds_the_central_model_bit_for_bit(strategy):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data())  # 20 steps: 4 pushes, each answered "your base plus your update"
    stats = strategy.connection.client.stats()
    assert stats["pushes_applied"] == 4 and stats["own_replies"] == 4
    for name, value in central(strategy).items():
        local = dict(trainer.lightning_module.named_parameters())[name].detach().numpy()
        np.testing.assert_array_equal(local.view(np.uint32), value.view(np.uint32))


DONE = SimpleNamespace(synchronize=lambda: None)  # a CPU copy's end: done when copy_ returns


@pytest.mark.parametrize("mode", ["asgd", "sync"])
@pytest.mark.integration
def test_pushes_through_shared_memory_train_the_bits_of_pushes_over_the_socket(mode):
    """The embedded PS is on this machine: a worker's dense updates go through shared memory, the
    socket carries headers only, and the run ends on the same bits as one that pushed the bytes. A worker
    whose tensors are staged (a GPU's path, driven here on CPU tensors) copies each push into that memory:
    no bytes on the socket either."""
    finals, stats, comm = [], [], []
    for shm, staged in ((True, False), (False, False), (True, True)):
        pl.seed_everything(7)
        module = Tiny()
        s = AsyncPSStrategy(mode=mode, shm_pushes=shm)
        if staged:
            s._exchange.staging = Staging(staged=lambda device: True, pin=False, mark=lambda device: DONE)
        try:
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_epochs=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(module, data())  # 20 steps, a push after each
            stats.append(s.connection.client.stats())
            comm.append(s.comm_stats())
            finals.append({n: p.detach().numpy().copy() for n, p in module.named_parameters()})
        finally:
            s._shutdown(wait_for_workers=0)
    per_push = 4 * (4 * 2 + 2)  # Linear(4, 2): 10 float32
    for k in (0, 2):
        assert stats[k]["push_local_bytes_in"] == comm[k]["push_local_bytes_up"] == 20 * per_push
    assert stats[1]["push_local_bytes_in"] == comm[1]["push_local_bytes_up"] == 0
    # the frames not sent, less the offsets the shared-memory headers name (a few bytes a tensor)
    for k in (0, 2):
        assert 20 * (per_push - 64) <= comm[1]["push_bytes_up"] - comm[k]["push_bytes_up"] < 20 * per_push
    for final in finals[1:]:
        for n in finals[0]:
            np.testing.assert_array_equal(finals[0][n].view(np.uint32), final[n].view(np.uint32))


def fit_tiny(strategy, callbacks=()) -> dict[str, np.ndarray]:
    pl.seed_everything(3)
    module = Tiny()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=list(callbacks), use_distributed_sampler=False)  # the same batches in both
    trainer.fit(module, data())  # 20 steps, a push after each
    return {n: p.detach().numpy().copy() for n, p in module.named_parameters()}


@pytest.mark.integration
def test_a_fit_too_short_for_randomks_lag_is_warned_about():
    s = AsyncPSStrategy(mode=Asgd(push_every=5), compressor=RandomK(0.01))
    try:
        with pytest.warns(UserWarning, match="about once in 100 pushes; this fit makes about 4 pushes per worker"):
            fit_tiny(s)  # 20 steps, a push every 5
    finally:
        s._shutdown(wait_for_workers=0)


class Wide(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(100, 10)


def fit_wide(compressor) -> tuple[dict, list[warnings.WarningMessage]]:
    """A 20-step fit of ``Wide``, a push after each step: the strategy's communication counts, the warnings."""
    s = AsyncPSStrategy(mode="asgd", compressor=compressor, shm_pushes=False)
    x = torch.randn(320, 100, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=16)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pl.seed_everything(5)
            pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_epochs=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False).fit(Wide(), loader)
        return s.comm_stats(), caught
    finally:
        s._shutdown(wait_for_workers=0)


@pytest.mark.integration
def test_randomks_default_fraction_is_raised_for_a_short_fit_and_its_pushes_carry_that_many_coordinates(caplog):
    with caplog.at_level(logging.INFO, logger="plug_asgd.strategy"):
        auto, caught = fit_wide("randomk")
    assert "this fit of about 20 pushes per worker encodes with RandomK(fraction=0.5," in caplog.text
    assert not [w for w in caught if "pushes per worker" in str(w.message)]  # the fit is long enough for its codec
    # 20 pushes: the default 1% (a wait of 100 pushes) raised to 10 / 20 = 50%, so k = 500 of the weight's 1,000
    # coordinates and 5 of the bias's 10; a Sparse frame is 4 bytes of block counts and 2 + 4 bytes a coordinate,
    # and each push's msgpack header adds a few hundred bytes (265 measured)
    frames = 20 * ((4 + 6 * 500) + (4 + 6 * 5))
    assert frames < auto["push_bytes_up"] < frames + 20 * 600, auto
    given, _ = fit_wide(RandomK(0.5))
    assert abs(auto["push_bytes_up"] - given["push_bytes_up"]) <= 20 * 8, (auto, given)  # headers' numbers vary
    one_percent, caught = fit_wide(RandomK(0.01))  # given: kept, and warned about
    assert one_percent["push_bytes_up"] < 20 * ((4 + 6 * 10) + (4 + 6 * 1) + 600) < frames
    assert [w for w in caught if "this fit makes about 20 pushes per worker" in str(w.message)]


@pytest.mark.parametrize("shm", [True, False])
@pytest.mark.integration
def test_a_lone_asgd_worker_pushes_its_weights_and_trains_the_bits_of_plain_lightning(shm):
    """Nothing races a lone worker: each push sends its weights, which the PS takes as its model
    (``w``, not ``base + (w - base)`` rounded), so the run is plain training, bit for bit."""
    plain = fit_tiny("auto")
    s = AsyncPSStrategy(mode="asgd", shm_pushes=shm)
    try:
        finals = fit_tiny(s)
        stats = s.connection.client.stats()
        assert stats["weights_pushes"] == stats["own_replies"] == 20 and stats["weights_not_current"] == 0
        assert stats["push_local_bytes_in"] == (20 * 4 * (4 * 2 + 2) if shm else 0)
        # through shared memory the worker lends its buffers: the PS keeps them as its model, and copies
        # them once, for the pull that ends fit (teardown)
        assert stats["weights_lent"] == (20 if shm else 0) and stats["lent_copies"] == (1 if shm else 0)
        central_now = central(s)
    finally:
        s._shutdown(wait_for_workers=0)
    for n, t in plain.items():
        np.testing.assert_array_equal(finals[n].view(np.uint32), t.view(np.uint32))
        np.testing.assert_array_equal(central_now[n].view(np.uint32), t.view(np.uint32))


@pytest.mark.integration
def test_a_later_trainer_of_the_process_trains_on_a_ps_of_its_own_and_the_earlier_strategy_is_freed():
    """Two Trainers one after the other in one process (a notebook, a sweep), whose embedded PSes take the same
    port (Lightning's main port). Before, the second one's PS could not listen, and its worker trained on, and
    took the weights of, the first one's PS, which stayed up; the strategy, its model and data stayed in memory
    until exit (an atexit entry each: 135 MB a fit measured). Now the second starts from its own model, on a PS of
    its own, as plain Lightning would, and the first's PS is stopped once the second connects."""
    plain = fit_tiny("auto")
    first = AsyncPSStrategy(mode="asgd")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=first, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Tiny(), data())
    first_ps = first.connection.embedded.process
    assert first_ps.poll() is None  # kept for the first Trainer's later stages
    second = AsyncPSStrategy(mode="asgd")
    try:
        finals = fit_tiny(second)
        assert second.ps_endpoint == first.ps_endpoint and second.connection.client.stats()["version"] == 20
        assert first_ps.poll() is not None and not group_members(first_ps.pid)
        with pytest.raises(RuntimeError, match="stopped when another AsyncPSStrategy of this process connected"):
            trainer.validate(trainer.lightning_module, data(), verbose=False)
    finally:
        second._shutdown(wait_for_workers=0)
    for n, t in plain.items():
        np.testing.assert_array_equal(finals[n].view(np.uint32), t.view(np.uint32))
    freed = weakref.ref(first)
    del first, trainer
    gc.collect()
    assert freed() is None


@pytest.mark.integration
def test_an_embedded_ps_refuses_a_worker_of_another_run_until_its_own_ps_answers(start_ps):
    """The case the run number is for: rank 1 of a job's second Trainer can say hello before rank 0 has stopped the
    first Trainer's PS, which still listens on the port. That PS (run 1) must refuse it, and the worker ask again
    until its own (run 2) answers, not train on the first one. Seen through real sockets: a worker of run 1 at a PS
    of run 2 is refused, every half second, until its timeout; one of run 2 is welcomed and learns the PS's pid (what
    rank 0 checks its own embedded PS by); a client that names no run (one made by hand) is welcomed too."""
    address = start_ps("asgd", run=2)
    pid = start_ps.started[address].pid
    stale, own, bare = (PSClient(address, rank=r, world_size=3, mode="asgd", run=run, heartbeat_s=None)
                        for r, run in ((0, 1), (1, 2), (2, None)))
    try:
        assert bare.hello(1, True, timeout=30)["pid"] == pid  # the PS is up
        with pytest.raises(PSError, match="serves run 2 of the process that started it, the worker asked for run 1"):
            stale.hello(1, True, timeout=2.0)
        assert own.hello(1, True, timeout=10)["pid"] == pid
        stats = own.stats()
        # asked again every half second until the timeout (4 tries, 3 on a slow machine), then refused
        assert 2 <= stats["refused"]["run_mismatch"] <= 4 and stats["workers"] == [1, 2]
    finally:
        for client in (stale, own, bare):
            client.close()


class Racer(pl.Callback):
    """Before the push of step 5 another push (of zeros) lands: the worker's base is no longer current."""

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == 4:
            strategy = trainer.strategy
            strategy.connection.client.push(strategy._exchange.version, {n: np.zeros(t.shape, np.float32)
                                                      for n, t in synced_tensors(module).items()})


@pytest.mark.integration
def test_raced_weights_fold_nothing_and_the_worker_pushes_its_update_instead():
    plain = fit_tiny("auto")
    s = AsyncPSStrategy(mode="asgd")
    try:
        finals = fit_tiny(s, [Racer()])
        stats = s.connection.client.stats()
        # 20 pushes of the worker + the racer's; the 5th's weights were refused, then its delta folded in
        assert stats["pushes_applied"] == 21 and stats["version"] == 21
        assert stats["weights_not_current"] == 1 and stats["weights_pushes"] == 18 and stats["own_replies"] == 19
        central_now = central(s)
    finally:
        s._shutdown(wait_for_workers=0)
    # The 5th push lands one version stale (the racer's) and is folded as sent: plain SGD keeps no momentum, so its
    # worker does not ask the PS to correct its scale (StalenessCompensation.correct, docs/momentum.md)
    for n, t in plain.items():  # the zeros and one rounding of base + (w - base) apart from plain training
        np.testing.assert_array_equal(finals[n], central_now[n])
        np.testing.assert_allclose(finals[n], t, rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_a_worker_guesses_the_own_model_while_waiting_only_after_an_own_reply(monkeypatch):
    """Pushes of updates only (as of a worker over the socket among others): the model an "own" reply
    means is made while the PS folds where the last reply was "own", after the reply where it was not,
    and thrown away where the guess was wrong; each way the worker ends on the PS's bits."""
    s = AsyncPSStrategy(mode="asgd")
    monkeypatch.setattr(s._exchange, "push_weights", lambda tensors: False)
    try:
        finals = fit_tiny(s, [Racer()])
        stats, comm = s.connection.client.stats(), s.comm_stats()
        central_now = central(s)
    finally:
        s._shutdown(wait_for_workers=0)
    assert stats["pushes_applied"] == 21 and stats["weights_pushes"] == 0
    # pushes 1-4 own; the racer's zeros land before push 5, whose guess is wrong; push 6 is not guessed
    # (the last reply was not own) yet answered own; pushes 7-20 guessed and own
    assert stats["own_replies"] == 4 + 1 + 14
    assert comm["own_guesses"] == 4 + 1 + 14 and comm["own_guesses_right"] == 4 + 14
    for n in finals:
        np.testing.assert_array_equal(finals[n].view(np.uint32), central_now[n].view(np.uint32))


@pytest.mark.integration
def test_a_worker_whose_base_is_its_own_weights_never_asks_for_an_own_reply():
    """With pull_every=2 every other push takes no model: the worker then keeps its own weights as its
    base, which need not be the central model of the version it was told, so the next push must
    get the whole model back."""
    s = AsyncPSStrategy(mode=Asgd(pull_every=2))
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(Tiny(), data())
        stats = s.connection.client.stats()
        assert stats["pushes_applied"] == 20 and stats["own_replies"] == 0
    finally:
        s._shutdown(wait_for_workers=0)


@pytest.mark.integration
def test_overlapped_pushes_of_a_lone_worker_lose_no_step(tmp_path):
    """A lone worker's model is the central one either way: overlapping its pushes with its next
    steps must end where pushing after each step ends, up to float rounding."""
    finals, stats = [], []
    for overlap in (False, True):
        pl.seed_everything(3)
        module = Tiny()
        s = AsyncPSStrategy(mode=Asgd(overlap=overlap))
        try:
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_epochs=2, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(module, data())  # 40 steps, a push after each
            stats.append(s.connection.client.stats())
            finals.append({n: p.detach().clone() for n, p in module.named_parameters()})
            center = central(s)
            for n, p in module.named_parameters():  # teardown leaves the central model in the module
                np.testing.assert_array_equal(p.detach().numpy(), center[n])
        finally:
            proc = s.connection.embedded.process
            s._shutdown(wait_for_workers=0)
            assert proc is None or proc.poll() is not None
    for st in stats:
        assert st["pushes_applied"] == 40 and st["own_replies"] == 40
    for n in finals[0]:
        torch.testing.assert_close(finals[1][n], finals[0][n], rtol=1e-5, atol=1e-6)


@pytest.mark.integration
def test_overlapped_sparse_pushes_train_and_the_worker_ends_on_the_central_model():
    """adacomp with ``overlap=True`` (bench.slowlink's adacomp-0.0033-overlap): each sparse push goes out while
    the next step computes, its reply merged later. A lone worker sends half of each tensor per push; the
    central model must separate the data (x0 > 0) as the plain pushes' does, every push folded in."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(320, 4, generator=g)
    y = (x[:, 0] > 0).long()
    for overlap in (False, True):
        pl.seed_everything(3)
        module = Tiny()
        before = module.layer.weight.detach().clone()
        s = AsyncPSStrategy(mode=AdaComp(fraction=0.5, overlap=overlap))
        try:
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_epochs=2, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
            trainer.fit(module, data())  # 40 steps, a push after each
            stats = s.connection.client.stats()
            center = central(s)
            assert stats["pushes_applied"] == 40, stats
            # steps computed while a push was in flight (35 of 39 measured; how many is the machine's timing)
            assert (s._exchange.stats()["overlapped_steps"] > 0) == overlap
        finally:
            s._shutdown(wait_for_workers=0)
        for n, p in module.named_parameters():  # teardown leaves the central model in the module
            np.testing.assert_array_equal(p.detach().numpy(), center[n])
        assert not torch.equal(module.layer.weight.detach(), before)
        accuracy = (module.layer(x).argmax(1) == y).float().mean().item()
        assert accuracy >= 0.95, (overlap, accuracy)


class WeightsAt(pl.Callback):
    """The module's weights after local step ``step`` (its push made, or sent), before the fit's end flushes."""

    def __init__(self, step: int) -> None:
        self.step, self.weights = step, None

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.weights = [p.detach().clone() for p in module.parameters()]


@pytest.mark.integration
def test_a_lone_sparse_worker_keeps_the_codec_residual_in_its_model_with_overlap_too():
    """Error feedback with the residual kept in the worker's model (docs/momentum.md, "local residual"): a lone
    worker's weights are then the central model plus what its codec holds back, which is exactly where plain
    SGD's steps lead; a push changes nothing in them. So too when each push is sent while the next step
    computes (``overlap=True``), where the merge of a reply must add the residual back: without it the model
    loses what was not sent yet (up to 3/4 of each step here), at every push."""
    import copy

    model = Tiny()
    expected = plain_sgd(copy.deepcopy(model), 12)
    for overlap in (False, True):
        module = copy.deepcopy(model)
        probe = WeightsAt(12)
        s = AsyncPSStrategy(mode=AdaComp(fraction=0.25, overlap=overlap))
        try:
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_steps=12, logger=False,
                                 callbacks=[probe], enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False)
            trainer.fit(module, data())
            assert s.ps_stats()["pushes_applied"] == 12
        finally:
            s._shutdown(wait_for_workers=0)
        assert probe.weights is not None
        for got, want in zip(probe.weights, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, o=overlap: f"overlap={o}: {m}")


@pytest.mark.parametrize("name, mode", [("async_ps", "asgd"), ("async_ps_adacomp", "adacomp"),
                                        ("async_ps_sync", "sync")])
def test_strategy_names_are_registered_with_lightning(name, mode):
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
    assert isinstance(trainer.strategy, AsyncPSStrategy) and trainer.strategy.mode.name == mode
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_bad_arguments_are_refused_at_construction():
    with pytest.raises(ValueError, match="unknown mode"):
        AsyncPSStrategy(mode="nope")
    with pytest.raises(ValueError, match="fraction"):
        AsyncPSStrategy(mode={"name": "adacomp", "fraction": 2.0})
    with pytest.raises(ValueError, match="push_every"):
        AsyncPSStrategy(mode=Asgd(push_every=0))
    with pytest.raises(ValueError, match="pull_every"):
        AsyncPSStrategy(mode=Downpour(pull_every=0))
    with pytest.raises(ValueError, match="tcp://"):
        AsyncPSStrategy(ps_address="localhost:2223")
    with pytest.raises(ValueError, match="values must be one of"):
        AsyncPSStrategy(mode=AdaComp(values="int8"))
    with pytest.raises(ValueError, match="unexpected keyword argument 'values'"):
        AsyncPSStrategy(mode={"name": "asgd", "values": "float16"})
    with pytest.raises(ValueError, match="heartbeat_s must be in"):
        AsyncPSStrategy(heartbeat_s=15.0, worker_timeout=20.0)
    with pytest.raises(ValueError, match="ps_threads"):
        AsyncPSStrategy(ps_threads=0)
    with pytest.raises(ValueError, match="unexpected keyword argument 'overlap'"):
        AsyncPSStrategy(mode={"name": "easgd", "overlap": True})
    with pytest.raises(ValueError, match="use mode='sync'"):
        AsyncPSStrategy(mode=OSP(overlap=False))
    with pytest.raises(ValueError, match="pull_every"):
        AsyncPSStrategy(mode=Downpour(overlap=True, pull_every=8))
    with pytest.raises(ValueError, match="alpha must be in"):
        AsyncPSStrategy(mode=EASGD(alpha=1.0))
    with pytest.raises(ValueError, match="staleness_bound must be"):
        AsyncPSStrategy(mode=SSP(staleness_bound=-1))
    with pytest.raises(ValueError, match="replicas_to_aggregate must be"):
        AsyncPSStrategy(mode=Sync(replicas_to_aggregate=0))
    with pytest.raises(ValueError, match="unknown compressor"):
        AsyncPSStrategy(compressor="gzip")
    assert AsyncPSStrategy(mode="losp").mode.overlap and not AsyncPSStrategy(mode="asgd").mode.overlap


def test_reduce_ops_of_torch_and_lightning_are_understood():
    assert op_name(ReduceOp.SUM) == "sum" and op_name("mean") == "mean" and op_name("avg") == "mean"
    assert op_name(ReduceOp.MAX) == "max" and op_name(None) == "mean"
    with pytest.raises(ValueError):
        op_name("product")


@pytest.mark.integration
def test_a_process_group_that_would_lockstep_the_workers_is_warned_about():
    from tests.conftest import free_port

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=AsyncPSStrategy(), max_steps=2, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        with pytest.warns(UserWarning, match="destroy_process_group"):
            trainer.fit(Tiny(), data())
        trainer.strategy._shutdown(wait_for_workers=0)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.faults
@pytest.mark.integration
def test_an_unreachable_ps_is_reported_with_its_address_not_a_hang(fault_report):
    s = AsyncPSStrategy(ps_address="tcp://127.0.0.1:9", connect_timeout=1.5)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_epochs=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"tcp://127\.0\.0\.1:9 within 1.5 s"):
        trainer.fit(Tiny(), data())
    waited = time.monotonic() - start
    assert waited < 1.5 + 5.0
    s._shutdown(wait_for_workers=0)
    fault_report(fault="PS unreachable at start (connect_timeout 1.5 s)", injected=1, handled=1, pushes_lost=0,
                 recovery_s=round(waited, 2), detail="a ConnectionError naming tcp://127.0.0.1:9, no hang")


@pytest.mark.integration
def test_a_mode_with_other_knobs_than_the_external_ps_is_refused_before_any_step(start_ps):
    """An external ``serve-ps --mode async_diloco`` without ``--outer`` folds with Nesterov: a strategy whose mode
    asks for SGD stops at its hello, told the flag to give, before any push; the PS's model is untouched."""
    from plug_asgd import AsyncDiLoCo

    address = start_ps("async_diloco")
    s = AsyncPSStrategy(mode=AsyncDiLoCo(inner_steps=2, outer="sgd"), ps_address=address, connect_timeout=20)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_steps=4, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    with pytest.raises(Exception, match=r"with outer=.*\"nesterov\".* but the worker's mode has outer=.*\"sgd\""
                                        r".*start the PS with --outer") as refused:
        trainer.fit(Tiny(), data())
    assert getattr(refused.value, "code", None) == "options_mismatch", refused.value
    s._shutdown(wait_for_workers=0)
    probe = PSClient(address, rank=0, world_size=1, mode="async_diloco", request_timeout=20, heartbeat_s=None)
    try:
        assert probe.hello(1, True)["initialized"] is False  # no worker got as far as the model
    finally:
        probe.close()


@pytest.mark.faults
@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_request_with_no_connection_to_queue_on_ends_within_its_timeout_not_a_hang(fault_report):
    """A worker's socket can be left with nowhere to queue a request: libzmq gives a connection up for good
    after some handshake failures (seen in CI: a keyed shard refusing a worker without keys, where
    test_security's sharded refusal hung for 120 s in a blocking send). Made here for certain with libzmq's
    own ZMQ_IMMEDIATE (queue only on completed connections) towards a port where nothing listens: the
    request must end within its timeout, naming the PS, as a request whose reply never comes does."""
    import zmq

    address = f"tcp://127.0.0.1:{free_port()}"
    client = PSClient(address, rank=0, world_size=1, mode="asgd", request_timeout=2, heartbeat_s=None)
    try:
        client._sock.disconnect(address)
        client._sock.setsockopt(zmq.IMMEDIATE, 1)
        client._sock.connect(address)
        start = time.monotonic()
        with pytest.raises(PSUnreachableError, match="could not send") as err:
            client.hello(stage=1, training=True)
        waited = time.monotonic() - start
        assert 2 <= waited < 2 + 3, waited
        assert address in str(err.value) and "serve-ps" in str(err.value), err.value
    finally:
        client.close()
    fault_report(fault="no connection to queue a request on (a PS that refused the handshake)", injected=1,
                 handled=1, pushes_lost=0, recovery_s=round(waited, 2),
                 detail="PSUnreachableError after the request's timeout (2 s), no hang")


def plain_sgd(model: Tiny, steps: int) -> list[torch.Tensor]:
    """Weights of ``model`` after ``steps`` steps of plain SGD without any PS, in the batch order that
    Lightning's injected DistributedSampler (shuffle=True, seed 0, epoch 0) gives one worker."""
    from torch.utils.data import DistributedSampler

    dataset = data().dataset
    loader = DataLoader(dataset, batch_size=16, sampler=DistributedSampler(dataset, 1, 0, shuffle=True, seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        opt.zero_grad()
        F.cross_entropy(model.layer(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def run_one_worker(strategy: AsyncPSStrategy, model: Tiny, steps: int) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data())


@pytest.mark.parametrize("push_every, pull_every", [(3, 2), (2, 5)])
@pytest.mark.integration
def test_downpour_pushes_every_push_every_and_loses_nothing_when_pulling(push_every, pull_every):
    import copy

    model = Tiny()
    expected = plain_sgd(copy.deepcopy(model), 12)
    s = AsyncPSStrategy(mode=Downpour(push_every=push_every, pull_every=pull_every))
    try:
        run_one_worker(s, model, 12)
        assert s.ps_stats()["pushes_applied"] == 12 // push_every  # exactly every push_every steps
        # one worker: pushes without a model and pulls that keep unpushed steps lose nothing
        for got, want in zip(model.parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=0)
    finally:
        s._shutdown(wait_for_workers=0)


@pytest.mark.parametrize("mode, push_every", [("osp", 1), ("losp", 3)])
@pytest.mark.integration
def test_overlapped_rounds_keep_the_progress_made_while_in_flight(mode, push_every):
    import copy

    model = Tiny()
    expected = plain_sgd(copy.deepcopy(model), 12)
    s = AsyncPSStrategy(mode={"name": mode, "push_every": push_every})
    try:
        run_one_worker(s, model, 12)
        assert s.ps_stats()["version"] == 12 // push_every
        for got, want in zip(model.parameters(), expected, strict=True):  # one worker: nothing lost
            torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=0)
    finally:
        s._shutdown(wait_for_workers=0)


@pytest.mark.integration
def test_easgd_center_after_one_exchange_is_the_elastic_step():
    import copy

    model = Tiny()
    w0 = [p.detach().clone() for p in model.parameters()]
    w3 = plain_sgd(copy.deepcopy(model), 3)
    s = AsyncPSStrategy(mode=EASGD(tau=3, alpha=0.25))
    try:
        run_one_worker(s, model, 3)
        center = central(s)
        assert s.ps_stats()["version"] == 1
        for (name, _), a, b in zip(model.named_parameters(), w0, w3, strict=True):
            want = a + 0.25 * (b - a)  # center moves alpha * (w - center); it started at w0
            np.testing.assert_allclose(center[name], want.numpy(), atol=1e-6)
    finally:
        s._shutdown(wait_for_workers=0)


@pytest.mark.integration
def test_agn_folds_in_the_accumulated_update_divided_by_the_steps():
    import copy

    model = Tiny()
    w0 = [p.detach().clone() for p in model.parameters()]
    w3 = plain_sgd(copy.deepcopy(model), 3)
    s = AsyncPSStrategy(mode=AGN(push_every=3))
    try:
        run_one_worker(s, model, 3)
        center = central(s)
        for (name, _), a, b in zip(model.named_parameters(), w0, w3, strict=True):
            np.testing.assert_allclose(center[name], (a + (b - a) / 3).numpy(), atol=1e-6)
    finally:
        s._shutdown(wait_for_workers=0)


@pytest.mark.integration
def test_eamsgd_refuses_an_optimizer_without_nesterov_momentum():
    s = AsyncPSStrategy(mode="eamsgd")
    try:
        with pytest.raises(ValueError, match="nesterov=True"):
            run_one_worker(s, Tiny(), 2)
    finally:
        s._shutdown(wait_for_workers=0)


def test_every_mode_and_compressor_pair_is_accepted_or_refused_by_the_stated_rule():
    from plug_asgd import compressors
    from plug_asgd.compressors import COMPRESSORS
    from plug_asgd.modes import MODES

    refused_modes = {"adacomp", "easgd", "eamsgd", "hogwild"}  # their own codec, or nothing to compress
    for mode in MODES:
        for name in COMPRESSORS:
            if name != "none" and mode in refused_modes:
                with pytest.raises(ValueError, match=f"compressor=.*mode='{mode}'"):
                    AsyncPSStrategy(mode=mode, compressor=name)
            else:
                s = AsyncPSStrategy(mode=mode, compressor=name)
                assert s.compressor == compressors.get(name)


class TinyAdam(Tiny):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


@pytest.mark.parametrize("module,scaled", [(Tiny, True), (TinyAdam, False)])
@pytest.mark.integration
def test_a_worker_scales_its_updates_unless_its_optimizer_normalizes_its_steps(module, scaled):
    s = AsyncPSStrategy(mode="asgd")
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=s, max_epochs=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module(), data())
        assert s._exchange.compensator.scale is scaled
    finally:
        s._shutdown(wait_for_workers=0)


def test_the_recipes_flags_map_onto_the_mode_and_the_codec():
    from plug_asgd.compressors import NoCompression, RandomK
    from plug_asgd.recipes.common import mode_and_codec

    assert mode_and_codec("asgd", compression=0.01) == (Asgd(), NoCompression())  # --compression: unused here
    assert mode_and_codec("adacomp", compression=0.02, values="float16") == (
        AdaComp(fraction=0.02, values="float16"), NoCompression())
    assert mode_and_codec("asgd", "randomk", compression=0.25, push_every=None) == (Asgd(), RandomK(0.25))
    assert mode_and_codec("easgd", tau=3, alpha=0.25)[0] == EASGD(tau=3, alpha=0.25)
    with pytest.raises(ValueError, match="tau does not apply to mode='asgd'"):
        mode_and_codec("asgd", tau=3)
    with pytest.raises(ValueError, match="bits does not apply"):
        mode_and_codec("asgd", "topk", bits=4)
