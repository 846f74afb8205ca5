"""plug_asgd.startup.gc_paused: a process's imports without the cycle collector's passes, what they made frozen."""

import gc

import pytest

from plug_asgd.startup import gc_paused


@pytest.fixture
def collections():
    """The collector's passes while the test runs, by generation; nothing left frozen after it."""
    seen = {0: 0, 1: 0, 2: 0}

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen[info["generation"]] += 1

    gc.callbacks.append(count)
    yield seen
    gc.callbacks.remove(count)
    gc.unfreeze()


def test_no_pass_runs_in_the_block_and_what_it_made_is_frozen_after_it(collections):
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with gc_paused():
        assert not gc.isenabled()
        at_entry = dict(collections)  # (before the block a thread's allocations may make a pass of generation 0)
        made = [[i] for i in range(50_000)]  # 50,000 tracked lists: about 70 passes of generation 0 with it on
        assert collections == at_entry  # none in the block
    assert at_entry[2] >= 1  # the full pass at its entry, over the garbage already there
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)
    more = [[i] for i in range(50_000)]  # the collector runs again once the block is over
    assert collections[0] > 0 and len(more) == len(made)


def test_garbage_made_before_the_block_is_collected_not_frozen(collections):
    import weakref

    class Node:
        pass

    gc.disable()  # no pass of its own may come first: an allocation may cross generation 0's threshold any time
    try:
        cycle = Node()
        cycle.me = cycle
        gone = weakref.ref(cycle)
        del cycle  # unreachable, but kept by its cycle until a pass of the collector
        assert gone() is not None
        with gc_paused():
            pass
        assert gone() is None
    finally:
        gc.enable()


def test_the_collector_stays_off_where_it_was_off_and_comes_back_when_the_block_raises(collections):
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(ImportError), gc_paused():
        import plug_asgd_no_such_module  # noqa: F401
    assert gc.isenabled()


def test_the_startup_benchmarks_table_is_its_runs_medians_and_their_ratio():
    from bench.startup import table

    def run(process: float, passes: list[int]) -> dict:
        return {"process_cpu_s": process, "import_cpu_s": process - 1, "import_wall_s": process - 0.5,
                "passes": passes}

    runs = {"collector on": [run(5.0, [788, 71, 6]), run(4.0, [790, 71, 6]), run(6.0, [788, 70, 6])],
            "collector paused": [run(3.0, [7, 0, 0]), run(3.5, [7, 0, 0]), run(2.5, [6, 0, 0])]}
    text, figures = table("pytorch_lightning", runs)
    assert figures["collector on"]["process_cpu_s"]["median"] == 5.0
    assert figures["collector paused"]["import_cpu_s"]["median"] == 2.0
    assert figures["collector on"]["passes_median"] == [788, 71, 6]
    assert figures["process_cpu_paused_over_on"] == 3.0 / 5.0 and figures["process_cpu_saved_s"] == 2.0
    assert "| collector on | 5.00 [4.00 .. 6.00] | 4.00 [3.00 .. 5.00] | 4.50 [3.50 .. 5.50] | 788 / 71 / 6 |" in text
    assert "paused over on: 0.60 (2.00 s saved per process)" in text
