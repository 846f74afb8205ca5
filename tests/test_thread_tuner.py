"""The thread tuner (plug_asgd.worker.thread_tuner) on an injected clock: it keeps one thread fewer only where the
steps timed there were shorter by its margin, sets torch's threads back otherwise and when the fit ends, and the
strategy starts it only where a codec encodes beside the step on the CPU and the user left the threads to it."""

from __future__ import annotations

import pytest

from plug_asgd.worker.thread_tuner import ThreadTuner


def run(at_all_ms: float, at_fewer_ms: float, threads: int = 2) -> tuple[ThreadTuner, list[int]]:
    """A tuner fed batch starts whose steps take ``at_all_ms`` on ``threads`` and ``at_fewer_ms`` on one fewer."""
    calls: list[int] = []
    current = [threads]

    def set_threads(n: int) -> None:
        calls.append(n)
        current[0] = n

    tuner = ThreadTuner(threads, set_threads, warmup=4, window=5, settle=2)
    now = 0.0
    for _ in range(100):
        tuner.batch_start(now)
        now += (at_all_ms if current[0] == threads else at_fewer_ms) / 1e3
        if tuner.done:
            break
    return tuner, calls


def test_one_fewer_is_kept_where_its_steps_are_shorter_by_the_margin():
    tuner, calls = run(20.0, 15.0)
    assert tuner.kept == 1 and calls == [1]
    assert tuner.medians == pytest.approx([0.020, 0.015])
    tuner.stop()  # the fit over: the threads as before it
    assert calls == [1, 2]


@pytest.mark.parametrize("fewer_ms", [25.0, 19.5])  # slower; faster by 2.5%, within the 5% margin
def test_every_thread_is_kept_where_one_fewer_is_not_faster_by_the_margin(fewer_ms):
    tuner, calls = run(20.0, fewer_ms, threads=4)
    assert tuner.kept == 4 and calls == [3, 4]


def test_the_counts_are_timed_after_the_warmup_and_the_settling_steps():
    # the warmup's steps (4) are slow, and the first step after the switch too: neither counts
    calls: list[int] = []
    tuner = ThreadTuner(2, calls.append, warmup=4, window=5, settle=2)
    steps = [0.5] * 4 + [0.020] * 5 + [0.5] * 2 + [0.015] * 5
    now = 0.0
    for step in steps:
        tuner.batch_start(now)
        now += step
    tuner.batch_start(now)
    assert tuner.medians == pytest.approx([0.020, 0.015]) and tuner.kept == 1


def test_a_fit_that_ends_before_the_switch_changes_nothing():
    calls: list[int] = []
    tuner = ThreadTuner(2, calls.append, warmup=4, window=5, settle=2)
    for i in range(7):
        tuner.batch_start(i * 0.01)
    tuner.stop()
    assert calls == []


def test_a_tuner_needs_two_threads():
    with pytest.raises(ValueError, match="2 threads or more"):
        ThreadTuner(1, lambda n: None)


@pytest.mark.parametrize("compressor, omp, expected", [("topk", None, True), (None, None, False),
                                                       ("topk", "2", False)])
def test_the_strategy_tunes_only_a_codecs_fit_whose_threads_it_chose(compressor, omp, expected, monkeypatch):
    import torch

    from plug_asgd import AsyncPSStrategy
    from plug_asgd.worker.thread_tuner import THREADS_CHOSEN

    monkeypatch.delenv(THREADS_CHOSEN, raising=False)
    if omp is None:  # Lightning chooses the threads (the strategy is made first; the workers it launches inherit it)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:  # the user's own setting stands
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    strategy = AsyncPSStrategy(compressor=compressor) if compressor else AsyncPSStrategy()
    strategy._exchange.start_fit([], 0, 1)
    monkeypatch.setattr(type(strategy), "root_device", property(lambda self: torch.device("cpu")))
    strategy._start_tuning()
    assert (strategy._tuner is not None) is expected
    with torch.inference_mode(False):
        torch.use_deterministic_algorithms(True)
        try:
            strategy._tuner = None
            strategy._start_tuning()
            assert strategy._tuner is None  # deterministic algorithms asked for: the threads stay
        finally:
            torch.use_deterministic_algorithms(False)
