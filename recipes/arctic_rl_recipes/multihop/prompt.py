"""The multi-hop prompt: the context's paragraphs as numbered documents, then the question."""

from __future__ import annotations

Paragraph = tuple[str, str, bool]
"""(title, text, is_supporting)"""


def document_line(number: int, title: str, text: str) -> str:
    return f"Document {number} ({title}): {text}"


def build_prompt(paragraphs: list[Paragraph], question: str) -> str:
    docs = "\n".join(document_line(i + 1, title, text) for i, (title, text, _) in enumerate(paragraphs))
    return f"{docs}\nQuestion: {question}\nAnswer:"
