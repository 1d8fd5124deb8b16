import json

import pytest

from engine.detokenizer import StreamingDetokenizer, TokenTable
from engine.stops import StopMatcher


def feed_all(matcher, pieces):
    out, stopped = [], False
    for p in pieces:
        text, stopped = matcher.feed(p)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return "".join(out), stopped


@pytest.mark.parametrize(
    "pieces, stops, expected",
    [
        (["Hello", " wor", "ld"], ("world",), ("Hello ", True)),
        (["a", "b", "c", "d"], ("bc", "abcd"), ("a", True)),  # earliest match wins
        (["x", "y", "z"], ("yz", "xyzq"), ("x", True)),
        (["abc"], ("zz",), ("abc", False)),
        (["ab", "c"], ("abd",), ("abc", False)),  # a held-back prefix that never completes
        (["<", "|end", "|>tail"], ("<|end|>",), ("", True)),
        (["no stops"], (), ("no stops", False)),
        (["an empty ", "stop"], ("",), ("an empty stop", False)),  # matches nothing
        (["ab", "cd"], ("", "cd"), ("ab", True)),
    ],
)
def test_stop_matcher(pieces, stops, expected):
    assert feed_all(StopMatcher(stops), pieces) == expected


def test_stop_matcher_never_emits_a_partial_stop_string():
    m = StopMatcher(("STOP",))
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("x") == ("STOx", False)


def test_streaming_detokenizer_is_utf8_safe(tiny):
    tok = tiny.tokenizer
    text = "naïve 😀 façade — 東京 and \u00e9"
    ids = tok.encode(text)
    detok = StreamingDetokenizer(tiny.token_table)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # the emoji is 4 bytes = 4 byte tokens here: nothing shows until the last one arrives
    assert any(p == "" for p in pieces)


def test_leading_space_is_kept_for_completions(tiny):
    ids = tiny.tokenizer.encode(" Paris")
    assert tiny.token_table.decode(ids) == " Paris"


def test_special_tokens_decode_to_nothing(tiny):
    assert tiny.token_table.decode([1, 2, 0]) == ""
    table = TokenTable.from_tokenizer(tiny.tokenizer)
    a = tiny.tokenizer.encode("a", add_special_tokens=False)
    assert len(a) == 1 and table.token_bytes[a[0]] == b"a" and table.decode(a + [2]) == "a"


def test_invalid_utf8_becomes_replacement_only_at_the_end(tiny):
    # a lone continuation byte followed by ASCII: replaced once, never held forever
    table = tiny.token_table
    lone = table.token_bytes.index(b"\x80")
    detok = StreamingDetokenizer(table)
    out = detok.add(lone) + detok.add(tiny.tokenizer.encode("a")[0]) + detok.flush()
    assert out == "\ufffda"


def test_max_token_bytes_bounds_a_text_only_where_tokens_are_its_bytes():
    """Byte-level BPE without a normalizer: the longest token's bytes (the special tokens'
    spellings count, since typed text tokenizes to them). With a normalizer, which may shorten
    the text it tokenizes, there is no such bound."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tiny import byte_tokenizer
    from tokenizers import AddedToken, normalizers

    hf = byte_tokenizer()
    table = TokenTable.from_tokenizer(TokenizerWrapper(hf))
    assert table.max_token_bytes == len(b"<|endoftext|>") == 13 and table.dropped_bytes == b""
    assert max(len(b) for b in table.token_bytes) == 1  # (the bytes themselves; specials decode to nothing)
    for text in ("", "a", "<|im_start|>" * 50, "\u00e9<|im_end|>" * 40 + "x" * 7, "\U0001f600 ab" * 30):
        assert 0 <= table.min_tokens(text) <= len(hf.encode(text, add_special_tokens=False)), text
    assert table.min_tokens("<|im_start|>" * 50) == 47  # (600 bytes; each is 1 token of 12)
    hf.backend_tokenizer.normalizer = normalizers.NFKC()
    assert TokenTable.from_tokenizer(TokenizerWrapper(hf)).max_token_bytes is None
    # an added token that swallows the whitespace around it: no bound (3 tokens for 200 kB)
    hf = byte_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": [AddedToken("<|sep|>", lstrip=True, rstrip=True, special=True)]})
    assert len(hf.encode("a" + " " * 100_000 + "<|sep|>" + " " * 100_000 + "b", add_special_tokens=False)) == 3
    table = TokenTable.from_tokenizer(TokenizerWrapper(hf))
    assert table.max_token_bytes is None and table.min_tokens("a" * 1000) is None


def test_bytes_a_tokenizer_drops_do_not_count_towards_the_bound():
    """SmolLM2's byte-level vocabulary lacks 21 byte symbols (0x04 among them): such bytes
    tokenize to nothing, so a text of them is no tokens, and the bound leaves them out."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tiny import byte_tokenizer
    from tokenizers import Tokenizer

    hf = byte_tokenizer()
    spec = json.loads(hf.backend_tokenizer.to_str())
    del spec["model"]["vocab"]["\u0104"]  # (byte 0x04's symbol in the GPT-2 byte map)
    hf._tokenizer = Tokenizer.from_str(json.dumps(spec))
    assert hf.encode("\x04" * 100 + "ab", add_special_tokens=False) == hf.encode("ab", add_special_tokens=False)
    table = TokenTable.from_tokenizer(TokenizerWrapper(hf))
    assert table.dropped_bytes == b"\x04" and table.min_tokens("\x04" * 100 + "ab") == 1
