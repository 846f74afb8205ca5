"""The regression case of ``tests/test_momentum.py`` in the quick tier: every mode, every codec, momentum SGD.

The same model, data, optimizer (``SGD(lr=0.05, momentum=0.9)``, Nesterov's for eamsgd), batch,
epochs and bounds as the real-process launch there, but each fit's 2 workers are threads of
this process that trade through the library's own exchange, client, wire and PS over ZeroMQ's
``inproc://`` transport (``tests/threaded_fit.py``): a fit takes about half a second instead of
a launch. The two agree where a fit is deterministic (the synchronous modes: an integration test of
``tests/test_momentum.py`` compares them). Where it is not, the workers start each step together
(``lockstep``), so that each step's second push lands 1 version stale, as most of the processes' pushes do:
left to the scheduler, threads of a loaded machine ran one after the other (downpour's 5 fits without
compensation ended at one loss, 5.67, below the bound, in a fresh-clone suite run), and nothing was stale.
Without compensation the asynchronous modes then diverge here as there (3 lockstep fits each: asgd 6.5e4 to
3.9e5, downpour 1.1e5 to 2.7e7, ssp 6.4e3 to 1.6e5, losp 92.1, the codecs 3.1e4 (powersgd) to 1.5e12, from
57.5), and with it every row ends below 4.3. The fits without compensation are in
``tests/test_momentum_quick_off.py``, a module of their own so that pytest-xdist can run them beside these.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from plug_asgd.modes import MODES
from tests.test_momentum import (
    CODEC_BOUND,
    CODECS,
    DETERMINISTIC,
    REGRESSION_BOUND,
    REPEATS,
    Regression,
    one_process_loss,
    threaded_fit,
    val_loss,
)


@pytest.fixture(scope="module")
def threaded():
    """{"on": {row: losses}, "one_process": loss, "before": loss}; about 35 s on 2 cores."""
    torch.manual_seed(0)
    before = val_loss(Regression())  # the seeded model every fit starts from (57.5)
    on = {row: [threaded_fit(row, None, lockstep=True) for _ in range(1 if row in DETERMINISTIC else REPEATS)]
          for row in [*MODES, *CODECS]}
    return {"one_process": one_process_loss(), "before": before, "on": on}


@pytest.mark.timeout(240)  # the fixture's fits: about 35 s on 2 idle cores
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_the_regression_model_with_momentum_sgd_in_threads(threaded, mode):
    runs = threaded["on"][mode]
    assert statistics.median(runs) <= REGRESSION_BOUND * threaded["one_process"], (mode, runs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_trains_the_regression_model_in_threads(threaded, codec):
    runs = threaded["on"][codec]
    assert threaded["before"] == pytest.approx(57.5, abs=0.1)
    assert statistics.median(runs) <= CODEC_BOUND * threaded["before"], (codec, runs)
