"""The one redaction step: configured secrets and credential-shaped tokens never survive it."""
from trajforge.pipeline.redact import REDACTED, redact


def test_configured_key_and_token_shapes_are_replaced(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_" + "a" * 30)
    body = ('{"error": "invalid key my-own-key-123456", "auth": "Bearer sk-proj-0123456789abcdef", '
            '"hub": "hf_' + "a" * 30 + '"}')
    out = redact(body, ["my-own-key-123456"])
    assert "my-own-key-123456" not in out and "sk-proj" not in out and "hf_aaaa" not in out
    assert out.count(REDACTED) == 3


def test_ordinary_text_and_short_values_are_kept():
    text = "Bearer of bad news; api_key=EMPTY; task-1 done"
    assert redact(text, ["EMPTY"]) == text
    assert redact(None) is None and redact("") == ""
