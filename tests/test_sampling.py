import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from engine.request import SamplingParams
from engine.sampling import LogitsPipeline, raw_logprobs

V = 50


def logits_rows(n, seed=0, scale=3.0):
    return mx.random.normal((n, V), key=mx.random.key(seed)) * scale


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=10, seed=1),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=2),
        SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.4, logit_bias=((3, 5.0), (7, -100.0)), seed=3),
    ],
)
def test_rows_match_one_row_decoding(params):
    """Row r of a k-row call chooses what a 1-row call at that position chooses, with that
    row's own history (the verify exactness contract)."""
    committed = [1, 2, 3, 4, 3, 9]  # prompt of 4, 2 generated
    draft = [3, 3, 11, 12]
    pipe = LogitsPipeline(params, seed=params.seed or 0, prompt_len=4)
    logits = logits_rows(len(draft) + 1)
    batched = pipe.choose(pipe.process(logits, committed, draft), len(committed)).tolist()
    history = list(committed)
    for r in range(len(draft) + 1):
        one = pipe.choose(pipe.process(logits[r : r + 1], history), len(history)).item()
        assert one == batched[r]
        if r < len(draft):
            history.append(draft[r])


def test_values_past_float32_act_as_their_limits():
    """A temperature too small for float32 is greedy, a top_p that rounds to 0 keeps the top
    token, and a repetition penalty that rounds to 0 does not divide by it: no NaN or empty
    distribution (each once sampled garbage: token 0 at temperature 1e-39)."""
    logits = logits_rows(4, seed=5)
    committed = [1, 2, 3]
    greedy = mx.argmax(logits, axis=-1).tolist()
    for params in (SamplingParams(temperature=1e-39), SamplingParams(temperature=1e-6, seed=4),
                   SamplingParams(temperature=2.0, top_p=5e-324, seed=4),
                   SamplingParams(temperature=1.0, top_p=1e-46, seed=4)):
        pipe = LogitsPipeline(params, seed=4, prompt_len=1)
        assert pipe.choose(pipe.process(logits, committed), 3).tolist() == greedy, params
    assert SamplingParams(temperature=1e-6).greedy and not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(top_p=1e-46).top_p == SamplingParams.EPS and SamplingParams(top_p=0.5).top_p == 0.5
    row = mx.array([[1.0, 2.0, -1.0] + [0.0] * (V - 3)])  # token 0 seen: a penalty below 1 lifts it
    pipe = LogitsPipeline(SamplingParams(temperature=0.0, repetition_penalty=5e-324), seed=0, prompt_len=1)
    out = pipe.process(row, [0, 2])
    assert bool(mx.all(mx.isfinite(out)).item()) and pipe.choose(out, 2).item() == 0


def test_penalties_see_only_their_rows_history():
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    pipe = LogitsPipeline(params, seed=0, prompt_len=2)
    flat = mx.zeros((2, V))
    out = pipe.process(flat, [0, 1], [5])  # row 0 has no generated tokens; row 1 has token 5
    assert out[0].tolist() == [0.0] * V
    assert out[1, 5].item() == -2.0 and out[1, 4].item() == 0.0


def test_logit_bias_forces_greedy_choice():
    pipe = LogitsPipeline(SamplingParams(temperature=0.0, logit_bias=((17, 100.0),)), 0, 1)
    assert pipe.choose(pipe.process(logits_rows(3), [0]), 1).tolist() == [17, 17, 17]


def test_fixed_seed_and_position_fix_the_token():
    pipe = LogitsPipeline(SamplingParams(temperature=1.0), seed=42, prompt_len=1)
    row = logits_rows(1)
    a = pipe.choose(row, 10).item()
    assert all(pipe.choose(row, 10).item() == a for _ in range(5))
    other = LogitsPipeline(SamplingParams(temperature=1.0), seed=43, prompt_len=1)
    draws = {other.choose(row, p).item() for p in range(10, 40)}
    assert len(draws) > 3  # positions (and seeds) give fresh draws


def test_gumbel_choice_follows_the_filtered_distribution():
    """20k draws (one position each) match softmax(filtered logprobs): chi-square test."""
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    pipe = LogitsPipeline(params, seed=7, prompt_len=1)
    row = logits_rows(1, seed=5, scale=1.5)
    probs = np.array(pipe.target_probs(row)[0].tolist())
    n = 20_000
    rows = mx.broadcast_to(row, (500, V))
    counts = np.zeros(V)
    for start in range(0, n, 500):
        for t in pipe.choose(rows, start).tolist():
            counts[t] += 1
    support = probs > 0
    assert counts[~support].sum() == 0  # never outside top-k/top-p
    expected = probs[support] * n
    _, p_value = stats.chisquare(counts[support], expected)
    assert p_value > 1e-3, (p_value, counts[support], expected)


def test_raw_logprobs_are_log_softmax_and_sorted():
    logits = logits_rows(3)
    chosen = mx.array([1, 2, 3])
    lp, ids, top = raw_logprobs(logits, chosen, 4)
    ref = np.array((logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist())
    np.testing.assert_allclose(np.array(lp.tolist()), ref[[0, 1, 2], [1, 2, 3]], rtol=1e-5)
    for r in range(3):
        order = np.argsort(-ref[r])[:4]
        assert ids[r].tolist() == order.tolist()
        assert top[r].tolist() == sorted(top[r].tolist(), reverse=True)


def test_rejection_rule_preserves_the_target_distribution():
    """Drafts x ~ q, verified with min(1, p/q) and residual resampling: the committed token's
    distribution equals p (chi-square, 20k trials), for a q quite different from p."""
    pipe = LogitsPipeline(SamplingParams(temperature=1.0), seed=11, prompt_len=1)
    target_logits = logits_rows(2, seed=21, scale=1.2)  # row 0 judges the draft, row 1 = bonus
    p = np.array(pipe.target_probs(target_logits)[0].tolist())
    q_logits = logits_rows(1, seed=22, scale=1.2)
    q = mx.softmax(q_logits, axis=-1)
    n = 20_000
    counts = np.zeros(V)
    accepted = 0
    drafts = mx.random.categorical(mx.broadcast_to(mx.log(q), (n, V)), key=mx.random.key(5)).tolist()
    for trial, x in enumerate(drafts):
        row_tokens, passed = pipe.verify(target_logits, [x], q, first_position=10 * trial)
        token = row_tokens[0].item()
        counts[token] += 1
        accepted += int(passed[0].item())
        if passed[0].item():
            assert token == x
    expected = p * n
    big = expected >= 5
    observed, exp = counts[big], expected[big]
    if (~big).any():
        observed, exp = np.append(observed, counts[~big].sum()), np.append(exp, expected[~big].sum())
    _, p_value = stats.chisquare(observed, exp * observed.sum() / exp.sum())
    assert p_value > 1e-3, p_value
    # the acceptance rate is sum_x min(p, q) (the overlap), not p(x) or 1
    overlap = np.minimum(p, np.array(q[0].tolist())).sum()
    assert abs(accepted / n - overlap) < 0.02


def test_greedy_verify_ignores_draft_probs():
    pipe = LogitsPipeline(SamplingParams(temperature=0.0), seed=0, prompt_len=1)
    logits = logits_rows(3, seed=9)
    best = mx.argmax(logits, axis=-1).tolist()
    q = mx.softmax(logits_rows(2, seed=10), axis=-1)
    row_tokens, passed = pipe.verify(logits, [best[0], (best[1] + 1) % V], q, first_position=4)
    assert row_tokens.tolist() == [best[0], best[1], best[2]]
    assert passed.tolist() == [True, False]
