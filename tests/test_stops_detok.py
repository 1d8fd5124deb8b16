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
    assert isinstance(TokenTable.from_tokenizer(tiny.tokenizer).token_bytes, list)


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
    from tokenizers import normalizers

    hf = byte_tokenizer()
    table = TokenTable.from_tokenizer(TokenizerWrapper(hf))
    assert table.max_token_bytes == len(b"<|endoftext|>") == 13
    assert max(len(b) for b in table.token_bytes) == 1  # (the bytes themselves; specials decode to nothing)
    hf.backend_tokenizer.normalizer = normalizers.NFKC()
    assert TokenTable.from_tokenizer(TokenizerWrapper(hf)).max_token_bytes is None
