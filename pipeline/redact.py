"""One redaction step for text that comes from outside (server error bodies, tracebacks, environment output).

A server may echo the request's Authorization header in an error body, and a model may print whatever it
read; such text ends up in logs, `failures.parquet`, negatives and published datasets. Everything of that
kind passes through `redact` before it is logged or stored.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable

REDACTED = "[REDACTED]"

# Environment variables whose values are secrets wherever they appear.
SECRET_ENV_VARS = ("TRAJFORGE_API_KEY", "OPENAI_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                   "HUGGINGFACE_TOKEN", "DEEPSEEK_API_KEY")

# Shapes of credentials: bearer tokens, OpenAI-style `sk-...` keys, Hugging Face `hf_...` tokens.
_TOKEN_SHAPES = re.compile(
    r"(?i:bearer)\s+[A-Za-z0-9._~+/=-]{8,}"
    r"|\bsk-[A-Za-z0-9_-]{8,}"
    r"|\bhf_[A-Za-z0-9]{16,}"
)


def known_secrets(extra: Iterable[str | None] = ()) -> list[str]:
    """The configured secrets: `extra` (e.g. a key from the config) plus the secret environment variables.

    Values shorter than 8 characters are left out: replacing them would mangle ordinary text ("EMPTY").
    """
    values = [*extra, *(os.environ.get(name) for name in SECRET_ENV_VARS)]
    return sorted({v for v in values if v and len(v) >= 8}, key=len, reverse=True)


def redact(text: str | None, secrets: Iterable[str | None] = ()) -> str | None:
    """`text` with every known secret and every credential-shaped token replaced by `[REDACTED]`."""
    if not text:
        return text
    for secret in known_secrets(secrets):
        text = text.replace(secret, REDACTED)
    return _TOKEN_SHAPES.sub(REDACTED, text)
