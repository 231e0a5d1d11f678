"""The one bind rule of every listening channel (--listen, --kv-listen, --master-addr, --http,
--metrics-host): an address beyond loopback needs CURVE keys (docs/security.md) or an explicit
--allow-insecure-network. Owns no state.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlparse


def is_loopback(endpoint: str) -> bool:
    u = urlparse(endpoint)
    if u.scheme in ("ipc", "inproc"):
        return True
    host = (u.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(flag: str, endpoint: str, curve_keys: str, allow_insecure: bool) -> None:
    """ValueError unless ``endpoint`` may be bound: on loopback (or ipc), or with CURVE keys,
    or with --allow-insecure-network. Anyone who reaches an open port without keys is served."""
    if curve_keys or allow_insecure or is_loopback(endpoint):
        return
    raise ValueError(f"{flag} {endpoint} is beyond loopback and --curve-keys is not set: anyone "
                     "who reaches it would be let in; give --curve-keys DIR (docs/security.md), or "
                     "--allow-insecure-network on a network you trust")
