"""Secrets in URIs (``--tracker-uri``, a data spec's URL): hidden wherever they are shown or stored.

``redact`` is the one function that hides them: in every URI in a text (a URI alone, a config
value, an error message that quotes one) it replaces the user info (``scheme://user:password@``)
and the values of token-like query parameters (token, key, secret, password, sig, auth, credential,
access_token, X-Amz-Signature, ...) with ``***``. The config line, the checkpoint's stored config,
the tracker's params, tracker.json, warnings and error lines all pass through it; the real value is
used only to connect.
"""

from __future__ import annotations

import re

HIDDEN = "***"
# up to the LAST '@' before the host: a password may hold a raw '@' (never a '/', '?' or '#')
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s?#'\"]+@")
_SECRET_NAME = r"[^=&;#\s'\"]*(?:token|key|secret|pass|pwd|sig|auth|credential|session)[^=&;#\s'\"]*"
_PARAM = re.compile(rf"(?P<name>[?&;]{_SECRET_NAME}=)[^&;#\s'\"]*", re.IGNORECASE)


def redact(text: str) -> str:
    """text with the secrets of every URI in it replaced by ``***``."""
    return _PARAM.sub(rf"\g<name>{HIDDEN}", _USERINFO.sub(rf"\g<scheme>{HIDDEN}@", text))
