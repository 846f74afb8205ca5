"""Staleness compensation: each remedy's arithmetic checked against values computed by hand."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from plug_asgd import AsyncPSStrategy, StalenessCompensation, compressors
from plug_asgd.compressors import TopKResidual
from plug_asgd.modes import MODES
from plug_asgd.worker.compensation import OFF, Compensator, resolve, scaled_step, warn_unknown_optimizers


def test_the_scale_is_one_over_one_plus_the_median_staleness_of_the_last_window_pushes():
    comp = Compensator(StalenessCompensation(window=3), prior_staleness=1)
    assert comp.update_scale() == 0.5  # before any push: the other worker's, as the prior says
    for s in (0, 2, 7):
        comp.observe(s)
    assert comp.staleness == 2.0 and comp.update_scale() == pytest.approx(1 / 3)
    comp.observe(1)  # the window drops the 0 seen first: the median of 2, 7, 1
    assert comp.staleness == 2.0
    comp.observe(0)  # 7, 1, 0
    assert comp.staleness == 1.0 and comp.update_scale() == 0.5
    comp.observe(0)
    assert comp.update_scale() == 1.0  # a worker nothing races pushes its update as it is
    once = Compensator(StalenessCompensation(), prior_staleness=0)  # a lone worker raced once
    for s in (0, 0, 0, 0, 1, 0):
        once.observe(s)
    assert once.update_scale() == 1.0
    assert Compensator(StalenessCompensation(scale=False), 3).update_scale() == 1.0


def test_lookahead_puts_the_central_model_staleness_versions_ahead_along_its_velocity():
    comp = Compensator(StalenessCompensation(), prior_staleness=1)
    t = {"w": torch.zeros(3)}
    assert comp.load(t, {"w": np.array([1.0, 2.0, 3.0], np.float32)}, version=10)  # no velocity yet
    assert t["w"].tolist() == [1.0, 2.0, 3.0]
    comp.observe(2), comp.observe(1)  # staleness 1.5
    # 4 versions later the central model moved by (2, -4, 0): 0.5, -1, 0 per version; 1.5 versions ahead
    assert not comp.load(t, {"w": np.array([3.0, -2.0, 3.0], np.float32)}, version=14)
    assert t["w"].tolist() == [3.75, -3.5, 3.0]
    # lookahead=False (several local steps per push): the central model, and the velocity base moves on
    assert comp.load(t, {"w": np.array([4.0, -2.0, 3.0], np.float32)}, version=15, lookahead=False)
    assert t["w"].tolist() == [4.0, -2.0, 3.0]
    comp.forget()
    assert comp.load(t, {"w": np.array([5.0, 0.0, 0.0], np.float32)}, version=16)


def test_the_local_residual_is_what_the_codec_holds_back_added_to_the_model():
    codec = TopKResidual(0.25)
    sent = codec.encode("w", np.array([1.0, -8.0, 0.5, 2.0], np.float32))
    assert sent.indices.tolist() == [1]  # k = 1 of 4: -8 goes, 1, 0.5 and 2 wait
    comp = Compensator(StalenessCompensation(lookahead=False), 1)
    t = {"w": torch.zeros(4)}
    assert not comp.load(t, {"w": np.array([10.0, 10.0, 10.0, 10.0], np.float32)}, 3, pending=codec.pending)
    assert t["w"].tolist() == [11.0, 10.0, 10.5, 12.0]
    off = Compensator(StalenessCompensation(lookahead=False, local_residual=False), 1)
    assert off.load(t, {"w": np.full(4, 10.0, np.float32)}, 3, pending=codec.pending)
    assert t["w"].tolist() == [10.0] * 4
    ef = compressors.get("sign").encoder()  # error feedback around sign: its residual has the tensor's shape
    ef.encode("m", np.array([[3.0, -1.0]], np.float32))
    assert ef.pending("m").shape == (1, 2)
    # which codecs' residuals go into the model: all with error feedback but powersgd's (docs/momentum.md)
    assert codec.local_residual
    assert all(compressors.get(c).encoder().local_residual for c in ("topk", "randomk", "sign"))
    assert not compressors.get("powersgd").encoder().local_residual
    assert not hasattr(compressors.get("qsgd").encoder(), "local_residual")  # no error feedback, no residual


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.1),
    lambda p: torch.optim.AdamW(p, lr=0.1),
    lambda p: torch.optim.RMSprop(p, lr=0.1, momentum=0.5),
    lambda p: torch.optim.NAdam(p, lr=0.1),
])
def test_masking_zeroes_the_momentum_exactly_where_an_update_was_sent(make):
    w = torch.nn.Parameter(torch.zeros(2, 3))
    opt = make([w])
    w.grad = torch.arange(1.0, 7.0).reshape(2, 3)
    opt.step()
    key = "momentum_buffer" if "momentum_buffer" in opt.state[w] else "exp_avg"
    before = opt.state[w][key].clone()
    assert (before != 0).all()
    comp = Compensator(StalenessCompensation(), 1)
    comp.mask([opt], w, np.array([1, 5]))
    after = opt.state[w][key].reshape(-1)
    assert after[[1, 5]].tolist() == [0.0, 0.0]
    keep = [0, 2, 3, 4]
    assert torch.equal(after[keep], before.reshape(-1)[keep]) and comp.masked == 2
    Compensator(StalenessCompensation(mask_momentum=False), 1).mask([opt], w, np.array([0]))
    assert after[0] != 0


def test_an_optimizer_whose_momentum_cannot_be_found_is_named_in_a_warning():
    class Lion(torch.optim.Optimizer):  # keeps its momentum under its own name
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

    w = torch.nn.Parameter(torch.zeros(2))
    with pytest.warns(UserWarning, match="Lion keeps no momentum under the names plug_asgd knows"):
        warn_unknown_optimizers([Lion([w])])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unknown_optimizers([torch.optim.SGD([w], lr=0.1, momentum=0.9), torch.optim.Adagrad([w])])


def test_a_scaled_step_moves_the_weights_by_the_fraction_and_restores_the_lr():
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.2, momentum=0.9)
    w.grad = torch.tensor([1.0, -2.0])
    with scaled_step(opt, 0.25):
        opt.step()
    assert w.tolist() == pytest.approx([1 - 0.05, 1 + 0.1]) and opt.param_groups[0]["lr"] == 0.2
    assert opt.state[w]["momentum_buffer"].tolist() == [1.0, -2.0]  # the state is untouched


def test_each_mode_gets_its_default_and_refuses_what_it_cannot_do():
    full = {m for m, cls in MODES.items() if cls.compensate == "full"}
    assert full == {"asgd", "adacomp", "downpour", "dynsgd", "ssp"}
    assert resolve(None, "agn", "unscaled") == StalenessCompensation(scale=False)
    assert AsyncPSStrategy(mode="agn").staleness_compensation == StalenessCompensation(scale=False)
    assert resolve(None, "hogwild", "step") == StalenessCompensation(scale=True, lookahead=False,
                                                                     local_residual=False, mask_momentum=False)
    for mode in ("sync", "localsgd", "sagn", "osp", "easgd", "eamsgd"):
        assert AsyncPSStrategy(mode=mode).staleness_compensation == OFF
        with pytest.raises(ValueError, match="does not go with mode"):
            AsyncPSStrategy(mode=mode, staleness_compensation=StalenessCompensation())
        assert AsyncPSStrategy(mode=mode, staleness_compensation=False).staleness_compensation == OFF
    assert AsyncPSStrategy(mode="asgd", staleness_compensation=False).staleness_compensation == OFF
    picked = StalenessCompensation(lookahead=False, window=4)
    assert AsyncPSStrategy(mode="asgd", staleness_compensation=picked).staleness_compensation == picked
    step_only = StalenessCompensation(scale=True, lookahead=False, local_residual=False, mask_momentum=False)
    assert AsyncPSStrategy(mode="hogwild", staleness_compensation=step_only).staleness_compensation == step_only
    with pytest.raises(ValueError, match="only its step can be scaled"):
        AsyncPSStrategy(mode="hogwild", staleness_compensation=StalenessCompensation())
    # losp: its rounds scaled (and its workers keeping their own share of the round in flight), nothing else;
    # nothing for the PS to correct
    rounds_only = replace(OFF, scale=True, correct=False)
    assert AsyncPSStrategy(mode="losp").staleness_compensation == rounds_only
    assert AsyncPSStrategy(mode="losp", staleness_compensation=replace(OFF, scale=True)).staleness_compensation \
        == rounds_only
    assert AsyncPSStrategy(mode="losp", staleness_compensation=False).staleness_compensation == OFF
    with pytest.raises(ValueError, match="only its rounds can be scaled"):
        AsyncPSStrategy(mode="losp", staleness_compensation=StalenessCompensation())
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        StalenessCompensation(window=0)
    with pytest.raises(TypeError, match="must be a bool, None, a StalenessCompensation or a dict"):
        AsyncPSStrategy(staleness_compensation="on")
    as_dict = AsyncPSStrategy(mode="asgd", staleness_compensation={"lookahead": False, "window": 4})
    assert as_dict.staleness_compensation == picked
    with pytest.raises(ValueError, match="unexpected keyword argument 'momentum'.*fields: scale"):
        AsyncPSStrategy(staleness_compensation={"momentum": 0.5})


def test_the_lr_scale_of_the_sgd_step_matches_a_plain_sgd_step():
    """hogwild's scaled step is the step of a learning rate times the factor, momentum buffer and all."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(5))
    b.data.copy_(a.data)
    opt_a = torch.optim.SGD([a], lr=0.05, momentum=0.9, nesterov=True)
    opt_b = torch.optim.SGD([b], lr=0.025, momentum=0.9, nesterov=True)
    for _ in range(3):
        g = torch.randn(5)
        a.grad, b.grad = g.clone(), g.clone()
        with scaled_step(opt_a, 0.5):
            opt_a.step()
        opt_b.step()
    assert torch.equal(a, b)


def test_the_scale_is_left_out_where_every_optimizer_normalizes_its_steps():
    from plug_asgd.worker.compensation import normalizes_steps

    w = torch.nn.Parameter(torch.zeros(2))
    for opt in (torch.optim.Adam([w]), torch.optim.AdamW([w]), torch.optim.RMSprop([w]), torch.optim.Adagrad([w])):
        assert normalizes_steps(opt)
    assert not normalizes_steps(torch.optim.SGD([w], lr=0.1, momentum=0.9))
    assert Compensator(StalenessCompensation(), 1, scale=False).update_scale() == 1.0
    assert Compensator(StalenessCompensation(), 1).update_scale() == 0.5


def test_under_adam_only_a_push_of_several_steps_is_scaled():
    """A push of one normalized step goes in unscaled, a chunk of several (downpour, or asgd with push_every > 1)
    at 1/(1 + s) as with SGD; the modes with remedies of their own (agn's division, losp's rounds) keep them."""
    from plug_asgd.modes import get
    from plug_asgd.worker.exchange import OverlapExchange, PushExchange

    w = torch.nn.Parameter(torch.zeros(2))
    for spec, exchange_kind, scale in (("asgd", PushExchange, 1.0), ("adacomp", PushExchange, 1.0),
                                       ("ssp", PushExchange, 1.0), ("downpour", PushExchange, 0.5),
                                       ({"name": "asgd", "push_every": 2}, PushExchange, 0.5),
                                       ("agn", PushExchange, 1.0), ("losp", OverlapExchange, 1.0)):
        mode = get(spec)
        exchange = exchange_kind(mode, compensation=resolve(None, mode.name, mode.compensate))
        exchange.start_fit([torch.optim.Adam([w])], rank=0, world_size=2)
        assert exchange.compensator.update_scale() == scale, spec
        if mode.name == "losp":
            assert exchange.share == 1.0 and exchange.scale() == 1.0


def test_agn_looks_ahead_where_its_optimizer_normalizes_its_steps_and_takes_nesterovs_form_where_it_does_not():
    """With several local steps per push only agn under Adam (and its kin) looks ahead: under heavy-ball SGD it takes
    Nesterov's form instead, and the other modes' chunks (downpour's) do not look ahead (docs/momentum.md)."""
    from plug_asgd.modes import get
    from plug_asgd.worker.exchange import PushExchange

    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([w], lr=0.05, momentum=0.9)
    for name, optimizers, lookahead, form in (
            ("agn", [torch.optim.Adam([w])], True, False), ("agn", [torch.optim.AdamW([w])], True, False),
            ("agn", [sgd], False, True), ("agn", [torch.optim.Adam([w]), sgd], False, True),
            ("downpour", [torch.optim.Adam([w])], False, True), ("asgd", [torch.optim.Adam([w])], True, False),
            ("asgd", [sgd], True, True)):
        mode = get(name)
        exchange = PushExchange(mode, compensation=resolve(None, name, mode.compensate))
        exchange.start_fit(optimizers, rank=0, world_size=4)
        assert (exchange.lookahead, exchange.nesterov_form_here) == (lookahead, form), (name, optimizers)
    sagn = get("sagn")
    exchange = PushExchange(sagn, compensation=resolve(None, "sagn", sagn.compensate))
    exchange.start_fit([torch.optim.Adam([w])], rank=0, world_size=4)
    assert not exchange.compensator.config.lookahead  # synchronous rounds: nothing looks ahead


def test_a_worker_tells_the_ps_what_staleness_its_update_was_scaled_for_and_only_when_it_scaled_it():
    from plug_asgd.modes import get
    from plug_asgd.worker.exchange import PushExchange

    w = torch.nn.Parameter(torch.zeros(2))
    sgd, adam = torch.optim.SGD([w], lr=0.05, momentum=0.9), torch.optim.Adam([w])
    for name, optimizer, expected in (("asgd", sgd, 2.0), ("downpour", sgd, 2.0), ("asgd", adam, None),
                                      ("downpour", adam, 2.0), ("dynsgd", sgd, 2.0)):
        mode = get(name)
        exchange = PushExchange(mode, compensation=resolve(None, name, mode.compensate))
        exchange.start_fit([optimizer], rank=0, world_size=3)  # before any push: the prior, 3 - 1
        assert exchange.scaled_for() == expected, name
        if expected is not None:
            assert exchange.scale() == 1 / (1 + expected)  # what the update was multiplied by
            for s in (0, 1, 1):
                exchange.compensator.observe(s)
            assert exchange.scaled_for() == 1.0 and exchange.scale() == 0.5
    # agn scales nothing: its division by push_every (3 steps, 3 workers) stands for the 2 pushes of the others that
    # land between two of its own, and a push staler than that, or than its typical staleness, is corrected
    for optimizer in (sgd, adam):
        exchange = PushExchange(get("agn"), compensation=resolve(None, "agn", "unscaled"))
        exchange.start_fit([optimizer], rank=0, world_size=3)
        exchange.since_push = 3
        assert exchange.scaled_for() == 2.0 and exchange.scale() == 1 / 3
        for s in (0, 1, 1):
            exchange.compensator.observe(s)
        assert exchange.scaled_for() == 2.0 and exchange.scale() == 1 / 3  # a lone or raced worker: still 3 - 1
        for s in (5, 5, 5, 5):
            exchange.compensator.observe(s)
        assert exchange.scaled_for() == 5.0 and exchange.scale() == 1 / 3  # typically staler: what it sees
    plain_agn = PushExchange(get("agn"), compensation=resolve(None, "agn", "unscaled"))
    plain_agn.start_fit([torch.optim.SGD([w], lr=0.1)], rank=0, world_size=3)
    assert plain_agn.scaled_for() is None  # no momentum: nothing to correct
    # dynsgd's PS scales an unscaled push by its staleness: a worker that would not say it scaled (no momentum to
    # correct, or correct=False) scales nothing, or its pushes would be scaled twice
    for optimizer, compensation in ((torch.optim.SGD([w], lr=0.1), None), (sgd, StalenessCompensation(correct=False))):
        exchange = PushExchange(get("dynsgd"), compensation=resolve(compensation, "dynsgd", "full"))
        exchange.start_fit([optimizer], rank=0, world_size=3)
        assert exchange.scaled_for() is None and exchange.scale() == 1.0
    uncorrected = PushExchange(get("asgd"), compensation=StalenessCompensation(correct=False))
    uncorrected.start_fit([sgd], rank=0, world_size=3)
    assert uncorrected.scaled_for() is None and uncorrected.scale() == 1 / 3  # scaled, the PS not told
    # plain SGD keeps no momentum: scaled all the same, but nothing for the PS to correct; with it beside a momentum
    # optimizer (a second one of the module), or an optimizer that does not say (no "momentum" key), the PS is told
    plain = torch.optim.SGD([w], lr=0.1)
    unknown = torch.optim.Optimizer([w], {"lr": 0.1})
    for optimizers, expected in (([plain], None), ([plain, sgd], 2.0), ([unknown], 2.0),
                                 ([torch.optim.SGD([w], lr=0.1, momentum=0.0, nesterov=False)], None)):
        exchange = PushExchange(get("asgd"), compensation=resolve(None, "asgd", "full"))
        exchange.start_fit(optimizers, rank=0, world_size=3)
        assert exchange.scaled_for() == expected and exchange.scale() == 1 / 3, optimizers


@pytest.mark.parametrize("weight_decay,maximize", [(0.0, False), (1e-3, False), (1e-3, True)])
def test_a_heavy_ball_step_in_nesterovs_form_is_torchs_nesterov_step(weight_decay, maximize):
    """The same gradients through SGD(momentum=0.9) in Nesterov's form and through SGD(nesterov=True) give the
    same weights, step after step (the first step included: its momentum is created by the step)."""
    from plug_asgd.worker.compensation import nesterov_form

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(4, 3))
    b = torch.nn.Parameter(a.detach().clone())
    heavy = torch.optim.SGD([a], lr=0.05, momentum=0.9, weight_decay=weight_decay, maximize=maximize)
    nesterov = torch.optim.SGD([b], lr=0.05, momentum=0.9, nesterov=True, weight_decay=weight_decay,
                               maximize=maximize)
    for _ in range(12):
        g = torch.randn(4, 3)
        a.grad, b.grad = g.clone(), g.clone()
        with nesterov_form(heavy):
            heavy.step()
        nesterov.step()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # the optimizer's own state is its heavy-ball momentum, untouched by the form
    assert torch.equal(heavy.state[a]["momentum_buffer"], nesterov.state[b]["momentum_buffer"])


def test_nesterovs_form_leaves_alone_what_is_not_a_heavy_ball_step():
    """Nesterov's SGD, dampened or plain SGD, Adam, and no optimizer at all step exactly as without it."""
    from plug_asgd.worker.compensation import nesterov_form

    def step(make, form: bool) -> torch.Tensor:
        torch.manual_seed(1)
        w = torch.nn.Parameter(torch.randn(6))
        opt = make([w])
        for _ in range(4):
            w.grad = torch.randn(6)
            with nesterov_form(opt) if form else scaled_step(opt, 1.0):
                opt.step()
        return w.detach().clone()

    for make in (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
                 lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, maximize=True),
                 lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.5),
                 lambda p: torch.optim.SGD(p, lr=0.05), lambda p: torch.optim.Adam(p, lr=0.01)):
        assert torch.equal(step(make, True), step(make, False))
    with nesterov_form(None):  # an exchange stepped without an optimizer (the exchanges' own tests)
        pass


def test_nesterovs_form_acts_in_every_mode_that_folds_stale_steps_and_only_while_others_race():
    """downpour and agn (several steps per push), hogwild, and the modes with the look-ahead whose workers scale
    take it; not a lone worker (staleness 0: plain Lightning's bits), nor a config that leaves it out, nor a worker
    that looks ahead without scaling (dynsgd's with the scale turned off, its PS scaling by staleness alone)."""
    from plug_asgd.modes import get
    from plug_asgd.worker.exchange import PushExchange, SharedExchange

    w = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([w], lr=0.05, momentum=0.9)
    for name, kind, world, expected in (("downpour", PushExchange, 2, True), ("agn", PushExchange, 2, True),
                                        ("hogwild", SharedExchange, 2, True), ("asgd", PushExchange, 2, True),
                                        ("adacomp", PushExchange, 2, True), ("dynsgd", PushExchange, 2, True),
                                        ("ssp", PushExchange, 2, True), ("downpour", PushExchange, 1, False),
                                        ("hogwild", SharedExchange, 1, False)):
        mode = get(name)
        exchange = kind(mode, compensation=resolve(None, name, mode.compensate))
        exchange.start_fit([sgd], rank=0, world_size=world)
        assert exchange.nesterov_steps is expected, (name, world)
    exchange = PushExchange(get("downpour"), compensation=StalenessCompensation(nesterov=False))
    exchange.start_fit([sgd], rank=0, world_size=2)
    assert not exchange.nesterov_steps
    exchange = PushExchange(get("dynsgd"), compensation=StalenessCompensation(scale=False))
    exchange.start_fit([sgd], rank=0, world_size=2)
    assert exchange.lookahead and exchange.scaled_for() is None and not exchange.nesterov_steps
    exchange = PushExchange(get("downpour"), compensation=resolve(None, "downpour", "full"))
    exchange.start_fit([sgd], rank=0, world_size=2)
    for s in (0, 0, 1):  # the others gone: the median staleness falls to 0, and the form with it
        exchange.compensator.observe(s)
    assert not exchange.nesterov_steps
    assert resolve(None, "losp", "round").nesterov is False  # its rounds have a remedy of their own
    with pytest.raises(ValueError, match="only its rounds can be scaled"):
        AsyncPSStrategy(mode="losp", staleness_compensation=replace(OFF, scale=True, nesterov=True))
    no_form = StalenessCompensation(scale=True, lookahead=False, local_residual=False, mask_momentum=False,
                                    nesterov=False)
    assert AsyncPSStrategy(mode="hogwild", staleness_compensation=no_form).staleness_compensation == no_form


def test_an_optimizer_with_a_momentum_out_of_reach_of_nesterovs_form_is_warned_about():
    from plug_asgd.modes import get
    from plug_asgd.worker.exchange import PushExchange

    class HeavyBall(torch.optim.Optimizer):  # momentum of its own, not torch's SGD
        def __init__(self, params):
            super().__init__(params, {"lr": 0.05, "momentum": 0.9})

    w = torch.nn.Parameter(torch.zeros(2))
    dampened = torch.optim.SGD([w], lr=0.05, momentum=0.9)  # one group of two dampened: its steps go as they are
    dampened.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "dampening": 0.1})
    for optimizer, warned in ((HeavyBall([w]), True), (torch.optim.SGD([w], lr=0.05, momentum=0.9), False),
                              (torch.optim.Adam([w]), False), (torch.optim.SGD([w], lr=0.05), False),
                              (dampened, True), (torch.optim.SGD([w], lr=0.05, momentum=0.9, maximize=True), False),
                              (torch.optim.SGD([w], lr=0.05, dampening=0.5), False)):  # dampening, no momentum
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            PushExchange(get("downpour"), compensation=resolve(None, "downpour", "full")).start_fit(
                [optimizer], rank=0, world_size=2)
            PushExchange(get("asgd"), compensation=resolve(None, "asgd", "full")).start_fit(
                [optimizer], rank=0, world_size=2)
            PushExchange(get("asgd"), compensation=StalenessCompensation(nesterov=False)).start_fit(  # no form
                [optimizer], rank=0, world_size=2)
        said = [str(c.message) for c in caught if "Nesterov's form" in str(c.message)]
        assert len(said) == (2 if warned else 0), (type(optimizer).__name__, said)


def test_an_exchange_takes_the_steps_of_a_fit_in_nesterovs_form():
    """Through ``Exchange.step`` itself, as the strategy calls it: downpour's heavy-ball steps are torch's Nesterov
    steps, hogwild's the Nesterov steps of half the learning rate (its scaled step, 2 workers)."""
    from types import SimpleNamespace

    from plug_asgd.modes import get
    from plug_asgd.worker.exchange import PushExchange, SharedExchange

    for kind, name, factor in ((PushExchange, "downpour", 1.0), (SharedExchange, "hogwild", 0.5)):
        torch.manual_seed(0)
        a = torch.nn.Parameter(torch.randn(5))
        b = torch.nn.Parameter(a.detach().clone())
        heavy = torch.optim.SGD([a], lr=0.05, momentum=0.9)
        nesterov = torch.optim.SGD([b], lr=0.05 * factor, momentum=0.9, nesterov=True)
        mode = get(name)
        exchange = kind(mode, compensation=resolve(None, name, mode.compensate))
        exchange.start_fit([heavy], rank=0, world_size=2)
        exchange.link = SimpleNamespace(fitting=True, world_size=2)  # a fit's stage, not joined: nothing pushed
        for _ in range(5):
            g = torch.randn(5)
            a.grad, b.grad = g.clone(), g.clone()
            exchange.step(heavy.step, heavy)
            nesterov.step()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
        assert heavy.param_groups[0]["lr"] == 0.05  # the scaled step's learning rate put back
