"""The HTTP rules `ember serve` and `ember gateway` share, so one request is read the same way by both.

- Authorization: `Bearer <token>` as RFC 7235 and OpenAI's SDK have it: the scheme in any case,
  any whitespace between scheme and token, the token trimmed.
- Content-Type of a JSON POST route: `application/json` (any parameters, e.g. charset, and the
  `+json` structured suffix); a missing Content-Type is read as JSON, since some clients send none.
  Anything else is refused with 415 Unsupported Media Type, including the
  `application/x-www-form-urlencoded` that `curl -d` sends unless told otherwise (the message says so).

Each server wraps a refusal in its own OpenAI-shaped error type.
"""

from __future__ import annotations

UNSUPPORTED_MEDIA_TYPE = 415
UNSUPPORTED_MEDIA_TYPE_CODE = "unsupported_media_type"


def parse_bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None when there is no such token."""
    if not authorization:
        return None
    parts = authorization.split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1].strip() or None


def is_json_content_type(content_type: str | None) -> bool:
    """Whether a JSON route accepts a body sent with this Content-Type (None: no header)."""
    if content_type is None or not content_type.strip():
        return True
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def unsupported_media_type_message(content_type: str) -> str:
    message = f"Content-Type must be application/json (or left out), got {content_type!r}."
    if content_type.lower().startswith("application/x-www-form-urlencoded"):
        message += " (curl -d sends that; add -H 'Content-Type: application/json'.)"
    return message
