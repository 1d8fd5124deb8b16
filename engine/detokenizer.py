"""UTF-8-safe streaming detokenization.

Each token id maps to the bytes it stands for (byte-level BPE through the GPT-2 byte alphabet,
sentencepiece through ``<0xNN>`` byte tokens and U+2581); an incremental UTF-8 decoder then
holds back a multi-byte character split across tokens until it is complete, so a stream never
shows U+FFFD for a character that arrives whole. Special (control) tokens decode to nothing,
as with ``skip_special_tokens=True``.

Unlike mlx-lm's ``BPEStreamingDetokenizer`` this keeps the leading space of the first token:
a completion of ``"The capital of France is"`` starts with ``" Paris"``.
Tokenizers of neither family fall back to re-decoding a growing window with the tokenizer.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, field

# pre-tokenizers that split text without dropping any of it (a Split may remove its matches)
_KEEPS_TEXT = {"Sequence", "ByteLevel", "Digits", "Split", "Regex", "Punctuation"}


def _text_bound(hf, backend, table: list[bytes], bmap: dict[str, int]) -> tuple[int | None, bytes]:
    """``TokenTable.max_token_bytes`` and ``dropped_bytes`` for a byte-level BPE: the most
    UTF-8 bytes of input text one token can consume, and the bytes the tokenizer drops (those
    whose byte symbol its vocabulary lacks: SmolLM2's lacks 21, among them 0x04 and 0xF1).
    ``(None, b"")`` where text can vanish in other ways or one token can swallow any amount of
    it: a normalizer; a pre-tokenizer that may drop text; a model other than plain BPE
    (``fuse_unk`` merges a run of unknown symbols); an added token that strips whitespace
    around itself (``lstrip``/``rstrip``) or matches whole words only. Added tokens are matched
    in the text as their literal spelling, so that spelling's length counts too (a token
    spelled in byte symbols decodes to fewer bytes)."""
    if backend.normalizer is not None:
        return None, b""
    pre = str(backend.pre_tokenizer) if backend.pre_tokenizer is not None else ""
    if not set(re.findall(r"(\w+)\(", pre)) <= _KEEPS_TEXT or "Removed" in pre:
        return None, b""
    model = backend.model
    if type(model).__name__ != "BPE" or getattr(model, "fuse_unk", False):
        return None, b""
    added = list(getattr(hf, "added_tokens_decoder", {}).values())
    if any(getattr(t, "lstrip", False) or getattr(t, "rstrip", False) or getattr(t, "single_word", False)
           for t in added):
        return None, b""
    vocab = backend.get_vocab(with_added_tokens=False)
    dropped = bytes(sorted(bmap[c] for c in bmap if c not in vocab))
    longest = max([len(b) for b in table] + [len(str(t).encode("utf-8")) for t in added])
    return (longest, dropped) if longest else (None, b"")


def _gpt2_byte_decoder() -> dict[str, int]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@dataclass
class TokenTable:
    """Bytes for every token id (``None`` when only the tokenizer can decode)."""

    token_bytes: list[bytes] | None
    tokenizer: object  # the Hugging Face tokenizer, for the fallback path
    special_text: dict[int, str] = field(default_factory=dict)  # hidden special ids -> their spelling
    # The most UTF-8 bytes of text one token can consume, where the tokenizer maps text to
    # tokens byte for byte (a byte-level BPE; see _text_bound), else None; and the bytes it drops.
    # A text of B bytes, D of them dropped ones, is at least ceil((B - D) / max_token_bytes)
    # tokens, known before tokenizing it (``min_tokens``).
    max_token_bytes: int | None = None
    dropped_bytes: bytes = b""

    def min_tokens(self, text: str) -> int | None:
        """A lower bound on the number of tokens ``text`` encodes to (special tokens the
        tokenizer adds, a BOS, come on top), or None where none is known."""
        if not self.max_token_bytes:
            return None
        data = text.encode("utf-8")
        if self.dropped_bytes:
            data = data.translate(None, self.dropped_bytes)
        return -(-len(data) // self.max_token_bytes)

    @classmethod
    def from_tokenizer(cls, tokenizer, visible=()) -> TokenTable:
        """``visible``: special token ids that decode to their text anyway (a model's tool-call
        markers, which the server must see to find the calls)."""
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        vocab_size = len(hf)
        pieces = hf.convert_ids_to_tokens(list(range(vocab_size)))
        special = set(getattr(hf, "all_special_ids", []) or []) - set(visible)
        spelled = {i: pieces[i] for i in special if 0 <= i < vocab_size and pieces[i]}
        decoder = None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is not None and backend.decoder is not None:
            decoder = type(backend.decoder).__name__ + repr(backend.decoder)
        table: list[bytes] = []
        if decoder and "ByteLevel" in decoder:
            bmap = _gpt2_byte_decoder()
            for i, piece in enumerate(pieces):
                if i in special or piece is None:
                    table.append(b"")
                elif all(c in bmap for c in piece):
                    table.append(bytes(bmap[c] for c in piece))
                else:  # an added token spelled in plain text
                    table.append(piece.encode("utf-8"))
            longest, dropped = _text_bound(hf, backend, table, bmap)
            return cls(table, hf, spelled, max_token_bytes=longest, dropped_bytes=dropped)
        if decoder and ("Metaspace" in decoder or "\u2581" in decoder or "ByteFallback" in decoder):
            for i, piece in enumerate(pieces):
                if i in special or piece is None:
                    table.append(b"")
                elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                    table.append(bytes([int(piece[3:5], 16)]))
                else:
                    table.append(piece.replace("\u2581", " ").encode("utf-8"))
            return cls(table, hf, spelled)
        return cls(None, hf, spelled)

    def decode(self, ids: list[int]) -> str:
        """Whole-sequence decode with the same rules (invalid bytes become U+FFFD)."""
        if self.token_bytes is None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", "replace")

    def char_starts(self, text: str, ids: list[int], typed: dict[int, str] | None = None) -> list[int] | None:
        """Where each of ``ids`` (``text`` tokenized) starts in ``text``, in characters, by
        matching the tokens' bytes against the text's UTF-8 bytes, skipping the bytes this
        tokenizer drops (``dropped_bytes``), within a token too (BPE merges across a dropped
        byte: SmolLM2 reads ``"?\\x1d?"`` as one token ``"??"``); a token holding part of a
        character starts where the character does, and a token with no bytes (a BOS or EOS the
        tokenizer added) where the token before it ended. ``typed``: positions whose hidden
        special token the text spells out, to that spelling (those bytes are in the text).

        Exact for a byte-level BPE whose text can only vanish through dropped bytes (where
        ``max_token_bytes`` is known); None elsewhere, or where the bytes do not line up (the
        text is not what ``ids`` tokenize from). The Hugging Face offsets are wrong within a
        pre-token that holds a dropped byte (SmolLM2, ``"!\\x1d?"``: "?" is put on the 0x1d),
        which this avoids."""
        if self.token_bytes is None or self.max_token_bytes is None:
            return None
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:  # (a lone surrogate)
            return None
        char_of = [i for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))] + [len(text)]
        typed, dropped, starts, p = typed or {}, set(self.dropped_bytes), [], 0
        for i, token in enumerate(ids):
            raw = typed[i].encode("utf-8") if i in typed else self.token_bytes[token]
            start = None
            for byte in raw:  # (dropped bytes may sit inside a token too: "?\x1d?" gives "??")
                while p < len(data) and data[p] != byte and data[p] in dropped:
                    p += 1
                if p == len(data) or data[p] != byte:
                    return None
                start = p if start is None else start
                p += 1
            starts.append(char_of[p if start is None else start])
        return starts

    def token_raw(self, token: int) -> bytes | None:
        """One token's own bytes (OpenAI chat ``logprobs`` ``bytes``): its UTF-8 fragment where
        :meth:`token_text` shows a ``bytes:`` placeholder (part of a character), else the UTF-8
        of what it shows; None for a special token hidden from the text (``<|im_end|>``): it
        has no bytes there (OpenAI: "null if there is no bytes representation"), so joining
        the entries' bytes still gives the text."""
        if token in self.special_text:
            return None
        if self.token_bytes is not None:
            raw = self.token_bytes[token]
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                return raw
        return self.token_text(token).encode("utf-8")

    def token_text(self, token: int) -> str:
        """One token on its own, as OpenAI ``logprobs.tokens`` shows it; a special token hidden
        from the text by its spelling (``<|im_end|>``), so a client can tell which one it is and
        two of them among ``top_logprobs`` stay two keys (vLLM shows them as "", which
        vllm-project/vllm#9463 reports as a bug: the end of text cannot be identified)."""
        spelled = self.special_text.get(token)
        if spelled is not None:
            return spelled
        if self.token_bytes is None:
            return self.tokenizer.decode([token])
        raw = self.token_bytes[token]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class StreamingDetokenizer:
    """Feed token ids, get back the newly completed text."""

    def __init__(self, table: TokenTable):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []  # fallback path only: the undecoded window
        self._emitted = ""

    def add(self, token: int) -> str:
        if self._table.token_bytes is not None:
            return self._utf8.decode(self._table.token_bytes[token])
        self._ids.append(token)
        text = self._table.tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self._emitted):]
        if text.endswith("\n"):  # keep the window short
            self._ids, self._emitted = [], ""
        else:
            self._emitted = text
        return delta

    def flush(self) -> str:
        """Text still held back (an incomplete character becomes U+FFFD)."""
        if self._table.token_bytes is not None:
            return self._utf8.decode(b"", final=True)
        text = self._table.tokenizer.decode(self._ids, skip_special_tokens=True)
        self._ids, delta, self._emitted = [], text[len(self._emitted):], ""
        return delta
