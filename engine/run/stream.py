"""A run's text as its tokens arrive, decoded incrementally: each token costs the decode of a few tokens, not of
the whole text (after vLLM's ``detokenize_incrementally`` and transformers' ``TextStreamer``)."""

from __future__ import annotations

LOOKBACK = 4  # settled tokens decoded again with each new one: merges and leading spaces read their left context
PENDING = 4  # tokens an unfinished character may span (UTF-8: 4 bytes) before the whole text is decoded again
_UNFINISHED = "\ufffd"  # what decode() shows for a character whose bytes have not all arrived


class TextStream:
    """``push(token)`` returns ``tokenizer.decode(tokens, skip_special_tokens=True)`` of every token pushed.

    The text of ``tokens[:read]`` is settled (it ends on a whole character); each push decodes the window
    ``tokens[start:]`` (LOOKBACK settled tokens, then the unsettled ones) and appends what the new tokens add."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.settled = ""  # the text of tokens[:read]
        self.start = self.read = 0
        self.window = ""  # the text of tokens[start:read]

    def push(self, token: int) -> str:
        self.tokens.append(token)
        now = self._decode(self.tokens[self.start:])
        if not now.startswith(self.window) or len(self.tokens) - self.read > PENDING:
            return self._settle(self._decode(self.tokens))  # the window is no longer the text's tail: all again
        added = now[len(self.window):]
        if added.endswith(_UNFINISHED):
            return self.settled + added  # shown as decode() shows it, settled once the character is whole
        return self._settle(self.settled + added)

    def _settle(self, text: str) -> str:
        self.settled, self.read = text, len(self.tokens)
        self.start = max(0, self.read - LOOKBACK)
        self.window = self._decode(self.tokens[self.start:self.read])
        return text

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
