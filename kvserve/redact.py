"""Secrets out of everything kvserve reports: /v1/stats (and so the dashboard and cluster stats), logs,
error messages. One place decides what is a secret: the API keys, and the credentials of any URL."""

from __future__ import annotations

import dataclasses
import re
from typing import Any


def redact_url(url: str) -> str:
    """`url` with its secrets replaced by ***: `password=` query values and, when there is an @,
    the password of the user part (all of it when it has no colon). Works on the raw string, so a
    malformed URL (an unescaped @ or / in the password) is redacted too, never leaked."""
    url = re.sub(r"([?&]password=)[^&#]*", r"\1***", url)
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    userinfo, at, host_part = rest.rpartition("@")
    if not at:
        return url
    user = f"{userinfo.split(':', 1)[0]}:***" if ":" in userinfo else "***"
    return f"{head}{sep}{user}@{host_part}"


def public_config(config: Any) -> dict[str, Any]:
    """A ServeConfig as it may be shown: the API keys masked, every string that holds a URL (any
    `scheme://`, e.g. kv_redis_url) redacted, warm prompts replaced by their length."""
    snapshot = dataclasses.asdict(config)
    for name, value in snapshot.items():
        if isinstance(value, str) and "://" in value:
            snapshot[name] = redact_url(value)
    for key in ("api_key", "admin_api_key"):
        snapshot[key] = "***" if getattr(config, key) else ""
    snapshot["warm"] = [f"<{len(t)} chars>" for t in config.warm]  # prompts are not echoed
    return snapshot
