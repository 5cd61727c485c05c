"""A tokenizer's encoder with a bounded memory of the texts it encoded: an API request sends the same documents
again and again, and tokenizing a long document costs more than the rest of its layout."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Callable

MAX_CHARS = 8 << 20  # texts remembered, by their total length (ids kept as 4-byte ints: ~8 MB at 4 chars a token)
MAX_TEXTS = 4096
MIN_CHARS = 64  # shorter texts (role tags, a question) cost less to tokenize than to remember


class CachedEncode:
    """``encode(text)``, each text of :data:`MIN_CHARS` or more tokenized once while it stays among the most
    recently used (:data:`MAX_CHARS` characters, :data:`MAX_TEXTS` texts). One instance wraps one tokenizer, so
    a text is its key: the tokenizer's identity is the instance's."""

    def __init__(self, encode: Callable[[str], list[int]], max_chars: int = MAX_CHARS, max_texts: int = MAX_TEXTS):
        self.encode, self.max_chars, self.max_texts = encode, max_chars, max_texts
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # the studio's engine thread and an API front's render threads share it

    def __call__(self, text: str) -> list[int]:
        if len(text) < MIN_CHARS or len(text) > self.max_chars:
            return self.encode(text)
        with self._lock:
            ids = self._ids.get(text)
            if ids is not None:
                self._ids.move_to_end(text)
                return ids.tolist()
        ids = array("i", self.encode(text))  # outside the lock: two threads may both tokenize a new text, once
        with self._lock:
            if text not in self._ids:
                self._ids[text] = ids
                self._chars += len(text)
            while self._chars > self.max_chars or len(self._ids) > self.max_texts:
                old, _ = self._ids.popitem(last=False)
                self._chars -= len(old)
        return ids.tolist()

    def __len__(self) -> int:
        return len(self._ids)
