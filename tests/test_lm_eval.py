"""lm-evaluation-harness against the real CLI server: a real client of echo + logprobs.

lm-eval's ``local-completions`` model turns each multiple-choice option into a loglikelihood
request (``/v1/completions`` with token-id prompts, ``echo``, ``logprobs=1``, ``max_tokens=1``)
and sums the echoed prompt logprobs of the option's tokens. The task is a tiny one shipped in
tests/data/lm_eval (20 easy questions, 4 options, chance 0.25); the tokenizer lm-eval needs is
written locally by ``python -m engine.convert --tokenizer-only`` (no hub access).

Checks: the harness produces a score, the default model scores well above chance, and every
loglikelihood lm-eval got from the server equals the one computed directly from the model's
logits (and so does lm-eval's ``is_greedy``, which reads ``top_logprobs``).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.model
pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: pip install 'lm-eval[api]'")

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def loaded():
    from engine.loader import load_target

    return load_target("default", weights="auto")


@pytest.fixture(scope="module")
def server():
    from benchmarks.peers.servers import Peer, Running

    # (mlx-lm's modules, not the fused pass: the scores are compared with mlx-lm's float32
    # forward to 1e-3; the default q16 pass moves logits by ~1e-4 of their scale, which summed
    # over a continuation's tokens reaches ~1e-3, and test_fused_cpu checks the fused pass layer
    # by layer. The fused pass with float32 activations would also match, but on an AVX2-only
    # CPU it made this test 129 s instead of 74: its start-up probe, and a float32 path ~4x
    # slower than q16's there)
    peer = Peer("specserve", "specserve", [sys.executable, "-m", "server", "--host", "127.0.0.1",
                                           "--port", "{port}", "--speculation", "off",
                                           "--fused", "off",
                                           "--log-level", "warning"], MODEL, "/ready")
    import tempfile

    with tempfile.TemporaryDirectory() as logs, Running(peer, Path(logs)) as running:
        yield running


# The steps of lm-eval's own `lm_eval run` (lm_eval/_cli/run.py: simple_evaluate with an
# EvaluationTracker, then the aggregated results and the samples written to --output_path), but
# with a TaskManager that does not index lm-eval's thousands of built-in task files: that index
# alone took 10-20 s of the CLI's 46 s here. The by-hand CLI command is in docs/benchmarks.md.
LM_EVAL_RUN = """
import sys
from lm_eval import simple_evaluate
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager

model_args, task_dir, out = sys.argv[1:]
tracker = EvaluationTracker(output_path=out)
results = simple_evaluate(model="local-completions", model_args=model_args, tasks=["specserve_easy_mc"],
                          task_manager=TaskManager(include_path=task_dir, include_defaults=False),
                          log_samples=True, evaluation_tracker=tracker)
samples = results.pop("samples")
tracker.save_results_aggregated(results=results, samples=samples)
tracker.save_results_samples(task_name="specserve_easy_mc", samples=samples["specserve_easy_mc"])
"""


def run_lm_eval(url: str, tokenizer_dir: Path, out: Path) -> subprocess.CompletedProcess:
    args = f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface," \
           f"tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1"
    cmd = [sys.executable, "-c", LM_EVAL_RUN, args, str(TASK_DIR), str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def direct_loglikelihood(loaded, context: str, continuation: str) -> tuple[float, bool]:
    """``log p(continuation | context)`` and whether every continuation token is the argmax,
    from one forward pass of the model, tokenized as lm-eval does (trailing spaces of the
    context move to the continuation; the continuation's tokens are those of the joined text
    after the context's)."""
    import mlx.core as mx

    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    hf = loaded.tokenizer._tokenizer
    whole = hf.encode(context + continuation, add_special_tokens=False)
    n_ctx = len(hf.encode(context, add_special_tokens=False))
    logits = loaded.model(mx.array(whole[:-1])[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = logprobs[n_ctx - 1:]
    targets = mx.array(whole[n_ctx:])
    picked = mx.take_along_axis(rows, targets[:, None], axis=-1)[:, 0]
    greedy = mx.all(mx.argmax(rows, axis=-1) == targets).item()
    return float(mx.sum(picked).item()), bool(greedy)


def test_lm_eval_local_completions_scores_and_matches_direct_loglikelihoods(server, loaded, tmp_path):
    from engine.loader import save_tokenizer

    tok_dir = save_tokenizer(loaded, tmp_path / "tokenizer")
    proc = run_lm_eval(server.url, tok_dir, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    scores = results["results"]["specserve_easy_mc"]
    acc = scores["acc,none"]
    print(f"lm-eval specserve_easy_mc: acc={acc:.2f} acc_norm={scores['acc_norm,none']:.2f}")
    assert acc >= 0.6, scores  # 0.85 measured; chance is 0.25

    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_*.jsonl")).open()]
    assert len(samples) == 20
    checked = 0
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"]):
            got_ll, got_greedy = float(resp[0][0]), resp[0][1] == "True"
            want_ll, want_greedy = direct_loglikelihood(loaded, args["arg_0"], args["arg_1"])
            assert math.isclose(got_ll, want_ll, rel_tol=1e-4, abs_tol=1e-3), (args, got_ll, want_ll)
            assert got_greedy == want_greedy, (args, got_greedy, want_greedy)
            checked += 1
    assert checked == 80
