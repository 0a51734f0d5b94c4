"""Deterministic stand-ins for a tokenizer and greedy decoding: the same prompt always yields the same
tokens, so "P/D output equals aggregated output" is a meaningful check against the emulators."""

from __future__ import annotations

import hashlib
import re
from typing import Any

_WORDS = re.compile(r"\w+|[^\w\s]")
_VOCAB = (
    "the", "cache", "blocks", "prefill", "decode", "token", "moves", "over", "a", "fast", "link",
    "and", "then", "stream", "ends", "here", "with", "one", "more", "word", "of", "light",
)
IMAGE_TOKENS = 64


def chat_prompt(messages: Any) -> str:
    """A chat template: the rendered prompt text of a list of OpenAI messages."""
    parts = []
    for message in messages if isinstance(messages, list) else []:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text":
                    texts.append(str(part.get("text", "")))
                elif isinstance(part, dict):
                    texts.append("<image>")
            content = " ".join(texts)
        parts.append(f"<|im_start|>{message.get('role', 'user')}\n{content or ''}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def completion_prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return " ".join(f"t{token}" for token in prompt)
    return str(prompt)


def count_tokens(text: str) -> int:
    images = text.count("<image>")
    return max(1, len(_WORDS.findall(text.replace("<image>", ""))) + images * IMAGE_TOKENS)


def generate(prompt: str, count: int) -> list[str]:
    """``count`` greedy tokens for ``prompt``; each token text starts with a space."""
    seed = hashlib.sha256(prompt.encode()).digest()
    tokens = []
    for i in range(count):
        digest = hashlib.sha256(seed + i.to_bytes(4, "big")).digest()
        tokens.append(" " + _VOCAB[digest[0] % len(_VOCAB)])
    return tokens
