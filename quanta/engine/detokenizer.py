"""Incremental detokenization: the text of a growing list of token ids, at a cost per token that does not
grow with the output.

Decoding a token alone is wrong for most tokenizers (SentencePiece drops a leading space at the start
of a decode, byte-level BPE splits multi-byte characters over tokens), and decoding the whole output
again at every token costs O(length) per token. As in vLLM's detokenize_incrementally, each step
decodes only a short window: the tokens of the last emitted piece (`prefix_offset:read_offset`, for
context) and those after it. The new text is the window's text minus the context's text; while it ends
in U+FFFD (an incomplete UTF-8 character, which a later token completes) nothing is emitted and the
window grows until the character is whole.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """Feed token ids with push(); `text` is the text of every id pushed so far, minus an unfinished
    trailing character."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0            # start of the context window
        self.read_offset = 0              # ids before this are in `text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def push(self, token: int) -> str:
        """Add one token id; returns the text it completes ("" while a character is unfinished)."""
        self.ids.append(token)
        context = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) <= len(context) or window.endswith("\ufffd"):
            return ""
        new = window[len(context):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new

    def extend(self, tokens: list[int]) -> str:
        """push() each token; returns the text they complete."""
        return "".join(self.push(t) for t in tokens)
