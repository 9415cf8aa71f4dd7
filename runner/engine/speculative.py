"""Speculative decoding's proposers: guesses of the next few tokens of a decoding sequence, which the engine core
verifies in one step over all of them (runner.engine.core; acceptance in runner.engine.sampler.Sampler.verify).

- :class:`NgramProposer` (prompt lookup, as vLLM's "ngram" and llama.cpp's lookup decoding): the tokens that followed
  the most recent earlier occurrence of the sequence's last n tokens, longest n first. Free to compute; it pays where
  text repeats (editing, extraction, code).
"""

from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, k: int, n_max: int, n_min: int = 1):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"prompt lookup needs 1 <= min <= max n-gram sizes, got {n_min} and {n_max}")
        self.k, self.n_max, self.n_min = k, n_max, n_min

    def propose(self, tokens: list) -> list:
        """Up to k tokens after the latest earlier match of tokens' last n (n from n_max down to n_min)."""
        hay = array("i", tokens).tobytes()  # token ids as 4-byte words: bytes.rfind searches in C
        for n in range(min(self.n_max, len(tokens) - 1), self.n_min - 1, -1):
            needle, end = hay[-4 * n:], 4 * (len(tokens) - 1)  # a match ends before the last token
            while (b := hay.rfind(needle, 0, end)) >= 0:
                if b % 4 == 0:  # on a token boundary
                    return tokens[b // 4 + n: b // 4 + n + self.k]
                end = b + 4 * n - 1
        return []
