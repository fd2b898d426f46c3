"""Made-up names for the synthetic world.

Names are built from random syllables so that no fact about them can be recalled from a model's
pre-training; the only way to answer a question is to search. Every word a `NameMaker` hands out is
new (case-insensitive), never one of the English words the passage templates use, so a name found in
a passage is always there because the generator put it there on purpose.
"""
from __future__ import annotations

import random

# Short, pronounceable syllables: names of 2-3 syllables stay a few tokens long, which a small
# model can copy into a search query and an answer.
_ONSETS = ("b c d f g h k l m n p r s t v z " * 3 + "br dr gr kr st tr th sh ch j").split()
_VOWELS = "a e i o u a e o ai ou".split()
_CODAS = ["", "", "", "", "n", "r", "l", "s", "m", "k", "x", "th"]
_ENDINGS = ["", "", "", "", "a", "o", "is", "en", "ia", "ar", "ek", "ine"]
# Random syllables occasionally spell something rude; such words are skipped.
_BLOCKED = ("sex", "fuc", "fuk", "cum", "shit", "tit", "ass", "dic", "rap", "nig", "cok", "kok",
            "pis", "poo", "fag", "gay", "jew", "nazi", "hitl", "kil", "die", "dead")


def pick(rng: random.Random, seq):
    """`rng.choice(seq)` at a third of the cost (one C call instead of a Python bit-sampling loop);
    this is the generator's innermost operation."""
    return seq[int(rng.random() * len(seq))]


class NameMaker:
    """Hands out unique capitalized made-up words; `reserved` words (the templates' vocabulary) are
    never produced. Deterministic for a given `rng` state."""

    def __init__(self, rng: random.Random, reserved: set[str] = frozenset()):
        self.rng = rng
        self.used: set[str] = {w.lower() for w in reserved}

    def _syllable(self) -> str:
        r = self.rng
        return pick(r, _ONSETS) + pick(r, _VOWELS) + pick(r, _CODAS)

    def word(self, min_syl: int = 2, max_syl: int = 2) -> str:
        """A new single capitalized word of `min_syl..max_syl` syllables (plus an optional ending)."""
        for attempt in range(1000):
            # Let words grow one syllable longer after many collisions, so huge worlds still finish.
            n = self.rng.randint(min_syl, max_syl) + attempt // 50
            w = "".join(self._syllable() for _ in range(n)) + pick(self.rng, _ENDINGS)
            if (4 <= len(w) <= 12 + attempt // 50 and w not in self.used
                    and not any(b in w for b in _BLOCKED)):
                self.used.add(w)
                return w.capitalize()
        raise RuntimeError("name space exhausted; this should not happen below 10M entities")

    def claim(self, phrase: str) -> bool:
        """Reserve a multi-word name; False if it is already taken."""
        key = phrase.lower()
        if key in self.used:
            return False
        self.used.add(key)
        return True
