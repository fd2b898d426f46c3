"""Where an API key may travel: the one rule every HTTP client that sends a key applies.

HTTPS anywhere; plain HTTP only to a loopback host (a key sent in clear over a network can be read
by anyone on the path), unless the caller opts in for a network it trusts. Used by the web search
engines (search_r1.search.web, no opt-in) and the OpenAI-compatible generators
(search_r1.rollout.backends.OpenAIGenerator, search_r1.grpo.openai_chat.OpenAIChatGenerator).
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlparse


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or the name localhost."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_key_transport(url: str, *, what: str = "base_url", opt_in: str | None = None,
                        allow_insecure_http: bool = False) -> str:
    """`url` unchanged if a key may be sent to it; else ValueError naming the fix.

    what: how the caller's users name the URL (in the message).
    opt_in: the flag or parameter that sets `allow_insecure_http` (None: the caller offers none).
    """
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{what} {url!r} must be an http(s) URL")
    if parsed.scheme == "http" and not is_loopback_host(parsed.hostname) and not allow_insecure_http:
        fix = f", or set {opt_in} if the network to {parsed.hostname} is trusted" if opt_in else ""
        raise ValueError(f"{what} {url!r} would send the API key unencrypted to a non-loopback host. Fix: use "
                         f"https://{fix} (plain http is allowed for loopback servers only)")
    return url
