"""Merging two runs' self-distillation data (benchmarks/gpu/merge_dspark_data.py)."""

import gzip
import json

from benchmarks.gpu.merge_dspark_data import main, merge


def _prompt(rid, source, split, text):
    return {"id": rid, "source": source, "split": split, "messages": [{"role": "user", "content": text}],
            "text": None}


def _example(rid, source, split, prompt, response=(7, 8)):
    return {"id": rid, "source": source, "split": split, "prompt": list(prompt),
            "response": list(response) if split == "train" else []}


def test_merge_keeps_heldout_prompts_out_of_training():
    base_prompts = [_prompt("q:0", "self_instruct", "train", "How do tides work?"),
                    _prompt("q:1", "self_instruct", "eval", "Why is the sky blue?"),
                    _prompt("c:0", "code", "train", "def f(): pass")]
    base = [_example("q:0", "self_instruct", "train", [1, 2]),
            _example("q:1", "self_instruct", "eval", [3, 4]),
            _example("c:0", "code", "train", [5])]
    new_prompts = [_prompt("q:0", "self_instruct", "train", "Write an email to my landlord."),  # clash, family
                   _prompt("q:1", "self_instruct", "train", "Why is the sky blue?"),  # = a held-out prompt
                   _prompt("q:2", "self_instruct", "train", "How do tides work?"),  # duplicate of base
                   _prompt("q:3", "self_instruct", "train", "Name three rivers."),
                   _prompt("q:4", "self_instruct", "eval", "What is a prime?")]
    new = [_example("q:0", "self_instruct", "train", [9]),
           _example("q:1", "self_instruct", "train", [3, 4]),
           _example("q:2", "self_instruct", "train", [1, 2]),
           _example("q:3", "self_instruct", "train", [6, 6]),
           _example("q:4", "self_instruct", "eval", [8, 8])]
    examples, prompts, summary = merge(base, base_prompts, new, new_prompts, suffix="s1")
    train = {r["id"]: r["prompt"] for r in examples if r["split"] == "train"}
    assert train == {"q:0": [1, 2], "c:0": [5], "q:3": [6, 6]}
    assert {r["id"] for r in examples if r["split"] == "eval"} == {"q:1", "q:4"}
    assert summary["renamed_ids"] == 1  # q:0 (another question under the same id); q:1 is the same text
    assert (summary["dropped_heldout_family"], summary["dropped_heldout_prompt"], summary["dropped_duplicate"]) == (1, 1, 1)
    assert [r["id"] for r in prompts][:3] == ["q:0", "q:1", "c:0"]  # the base run's rows first
    assert {r["id"] for r in prompts} == {"q:0", "q:1", "c:0", "q:3", "q:4"}
    assert summary["response_tokens"] == 6


def test_main_rewrites_the_run_data(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    with gzip.open(base / "examples.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(_example("a", "code", "train", [1])) + "\n")
    with gzip.open(base / "prompts.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(_prompt("a", "code", "train", "x = 1")) + "\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "examples.jsonl").write_text(json.dumps(_example("b", "code", "train", [2])) + "\n")
    (run / "prompts.jsonl").write_text(json.dumps(_prompt("b", "code", "train", "y = 2")) + "\n")
    assert main(["--base", str(base / "examples.jsonl.gz"), "--base-prompts", str(base / "prompts.jsonl.gz"),
                 "--into", str(run), "--summary", str(tmp_path / "s.json")]) == 0
    rows = [json.loads(line) for line in (run / "examples.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    assert json.loads((tmp_path / "s.json").read_text())["train_rows"] == 2
