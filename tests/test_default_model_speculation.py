"""Greedy speculative decoding equals plain greedy decoding on the real default model."""

import pytest
from helpers import run

from engine import SpeculativeParams

pytestmark = pytest.mark.model

CODE = [
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    mid = len(items) // 2\n"
    "    left = merge_sort(items[:mid])\n    right = merge_sort(items[mid:])\n    return merge(left, right)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "for (int i = 0; i < n; i++) {\n    sum += values[i] * weights[i];\n}\nprintf(\"%d\\n\", sum);\n",
    'SELECT name, COUNT(*) AS orders\nFROM customers JOIN orders ON customers.id = orders.customer_id\n'
    'GROUP BY name\nORDER BY orders DESC;\n',
    "fn main() {\n    let v: Vec<i32> = (1..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
]
PROSE = [
    "Write a short essay about the ocean.", "Explain why the sky is blue.",
    "Describe a walk through a forest in autumn.", "What are the benefits of regular exercise?",
    "Tell me a story about a robot who learns to paint.", "Summarize the history of the printing press.",
    "Give three tips for writing clear emails.", "Why do cats purr?",
    "Describe how a bill becomes a law.", "What makes a good friend?",
    "Write a haiku about rain, then explain it.", "List the planets of the solar system in order.",
]
MULTI = [
    "Répète cette phrase: « Le café est très bon à Paris, n'est-ce pas ? »",
    "日本語の文を繰り返してください: 東京は日本の首都です。東京は日本の首都です。",
    "Emoji time 😀🎉🚀: repeat after me 😀🎉🚀 😀🎉🚀",
    "Straße, Größe, Übermaß — ÄÖÜ äöü ß. Again: Straße, Größe, Übermaß —",
    "Ελληνικά: Καλημέρα κόσμε. Καλημέρα κόσμε. Καλημέρα",
]


def _prompts(tok):
    chat = lambda text: tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    out = []
    for code in CODE:
        out.append((tok.encode("Repeat this code exactly.\n" + code + "\nRepeated:\n" + code[: len(code) // 3]), {}))
        out.append((chat("Rename the function and rewrite it:\n" + code), {}))
        out.append((tok.encode(code + code[: len(code) // 2]), {"stop": ("return",)}))
    for p in PROSE:
        out.append((chat(p), {}))
        out.append((tok.encode(p + "\n\n"), {"stop": ("\n\n",)}))
    for p in MULTI:
        out.append((tok.encode(p), {}))
        out.append((chat(p), {}))
    out.append((tok.encode("one two three " * 20), {}))
    out.append((tok.encode("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"), {}))
    out.append((tok.encode('{"name": "a", "id": 1}\n{"name": "b", "id": 2}\n{"name": "c", "id": 3}\n'), {}))
    return out


def test_greedy_identity_on_default_model(default_engine):
    """prompt_lookup and the shipped DSpark drafter (forced to draft every cycle, so its drafts
    are verified far more often than the scheduler would allow) on every prompt, auto on every
    other one.

    The scheduler's cost curve is pinned for the test (T(k) = T(1) (1 + 0.25 (k - 1)), no online
    refresh), so how much prompt lookup drafts does not depend on the machine's load: under a
    loaded CPU the measured curve once left auto with 100 accepted tokens instead of ~480."""
    tok = default_engine.loaded.tokenizer
    assert default_engine.dspark is not None, "the shipped DSpark drafter did not load"
    prompts = _prompts(tok)
    assert len(prompts) >= 50
    accepted = {"prompt_lookup": 0, "dspark": 0, "auto": 0}
    cost = default_engine.cost
    saved = (cost.verify_cost, cost.alpha)
    cost.reset([cost.T(1) * (1 + 0.25 * k) for k in range(cost.max_rows)])
    cost.alpha = 0.0
    try:
        for i, (ids, kw) in enumerate(prompts):
            max_tokens = 24 + (i * 7) % 29  # lands mid-block at varied offsets
            plain, plain_text, last_plain = run(default_engine, ids, "off", max_tokens=max_tokens, **kw)
            for method in ("prompt_lookup", "dspark", "auto")[: 3 if i % 2 else 2]:
                params = SpeculativeParams(method, min_draft_tokens=2 if method == "dspark" else 0)
                spec, spec_text, last = run(default_engine, ids, "x", max_tokens=max_tokens, speculative=params, **kw)
                assert spec == plain, (method, i, tok.decode(ids)[:80])
                assert spec_text == plain_text
                assert last.finish_reason == last_plain.finish_reason
                assert last.completion_tokens == len(spec)
                accepted[method] += last.stats.total.num_accepted_tokens
    finally:
        cost.reset(saved[0])
        cost.alpha = saved[1]
    print("ACCEPTED", accepted)
    # (on a 2-vCPU AVX2 machine, outputs of 24-52 tokens gave 615 / 337 / 348 accepted tokens;
    # 40-68 tokens gave 822 / 450 / 463)
    assert accepted["prompt_lookup"] > 200, accepted
    assert accepted["dspark"] > 100 and accepted["auto"] > 200, accepted
