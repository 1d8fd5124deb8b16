"""benchmarks/peers/run.py bookkeeping, without servers: request list, identity and ratios, and
the time budget that bounds a run."""

from types import SimpleNamespace

from benchmarks.peers.run import build_items, measure, report


def row(workload, index, text, tokens, decode_s, ttft_s=0.1):
    return {"workload": workload, "index": index, "text": text, "tokens": tokens, "decode_s": decode_s,
            "ttft_s": ttft_s, "tokens_from": "usage"}


def test_build_items_skips_sessions_and_caps_max_tokens():
    items = build_items(["copy", "agent_session"], 64)
    assert [i["workload"] for i in items] == ["copy"] * 3  # the session's turns depend on replies
    assert all(i["max_tokens"] == 64 and i["kind"] == "completion" for i in items)
    assert {i["max_tokens"] for i in build_items(["copy"], None)} == {256}


def test_report_counts_identity_per_round_and_ratios_of_decode_speed():
    base = [row("copy", 0, "abcdef", 11, 1.0), row("copy", 1, "xyz", 6, 1.0)]
    rounds = [{"off": {"rows": base},
               "mlx_lm": {"rows": [row("copy", 0, "abcdef", 11, 2.0), row("copy", 1, "xyz", 6, 0.5)]},
               "llama": {"rows": [row("copy", 0, "abcXef", 11, 0.5), row("copy", 1, "xyz", 6, 0.5)]}}]
    out = report(rounds, ["off", "mlx_lm", "llama"], ["copy"], "off")["copy"]
    assert out["off"]["decode_tokens_per_s"] == 15 / 2.0  # tokens after the first over decode time
    assert out["mlx_lm"]["identical_to_baseline"] == "2/2" and out["mlx_lm"]["divergences"] == []
    assert out["llama"]["identical_to_baseline"] == "1/2"
    assert out["llama"]["divergences"] == [{"prompt": 0, "first_diff_char": 3}]
    assert out["mlx_lm"]["x_vs_off"] == (15 / 2.5) / (15 / 2.0)
    assert out["llama"]["x_vs_mlx_lm"] == (15 / 1.0) / (15 / 2.5)


def test_measure_stops_before_a_round_that_would_overrun_the_budget(monkeypatch):
    clock = iter([0.0, 10.0, 20.0, 30.0, 40.0])  # each round takes 10 s
    monkeypatch.setattr("benchmarks.peers.run.time.perf_counter", lambda: next(clock))
    made = []

    def rounds():
        for _ in range(4):
            made.append(1)
            yield {"off": {"rows": [row("copy", 0, "a", 5, 1.0)], "ready_s": 1.0,
                           "loadavg_before": 0.0, "loadavg_after": 0.0}}

    results = {"workloads": ["copy"], "rounds": []}
    args = SimpleNamespace(out=None, repeats=4, time_budget=25.0)
    measure(rounds(), results, ["off"], args)
    assert len(results["rounds"]) == 2 and len(made) == 2  # a third would end at 30 s > 25 s
    assert results["overall"]["off"]["requests"] == 2

    results = {"workloads": ["copy"], "rounds": []}
    clock = iter([0.0, 10.0, 20.0, 30.0, 40.0])
    measure(rounds(), results, ["off"], SimpleNamespace(out=None, repeats=4, time_budget=None))
    assert len(results["rounds"]) == 4
