"""The offline scheduler replay (benchmarks/replay_scheduler.py) on synthetic outputs."""

from benchmarks.replay_scheduler import replay

FLAT = [1.0, 1.0, 1.05, 1.1] + [1.1 + 0.05 * i for i in range(1, 13)]
STEEP = [1.0 + 0.6 * i for i in range(16)]


def test_copying_output_pays_and_novel_output_costs_nothing_extra():
    block = list(range(100, 140))
    copying = {"copy": [[block + [7, 8], block[:38]]]}  # the output repeats the prompt
    novel = {"novel": [[[1, 2, 3, 4], list(range(200, 260))]]}  # nothing to look up
    fast = replay(copying, FLAT)["copy"]
    assert fast["speedup"] > 3.0 and fast["accepted"] >= 30
    none = replay(novel, FLAT)["novel"]
    assert none["speedup"] == 1.0 and none["drafts"] == 0
    # a steep curve (every row costs 0.6 of a step) makes the same copy worth less
    assert 1.0 < replay(copying, STEEP)["copy"]["speedup"] < fast["speedup"]


def test_draft_overhead_is_charged_per_drafted_cycle():
    block = list(range(100, 140))
    copying = {"copy": [[block + [7, 8], block[:38]]]}
    base = replay(copying, FLAT)["copy"]
    slow = replay(copying, FLAT, draft_overhead=0.5)["copy"]
    assert slow["drafts"] == base["drafts"] > 0
    assert slow["speedup"] < base["speedup"]
