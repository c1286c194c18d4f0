"""Datasets streamed from the Hugging Face Hub, with a fast, one-line failure offline.

``load_hub_dataset`` first checks the offline flags (``HF_HUB_OFFLINE`` /
``HF_DATASETS_OFFLINE``), then probes the endpoint (``HF_ENDPOINT``, through its proxy if
one applies) with a bounded TCP connect, and only then calls ``load_dataset``.
"""

import os
import socket
import threading
import urllib.parse
import urllib.request

from torchtitan.components.errors import AssetError


def _hub_offline() -> bool:
    import datasets

    flags = (os.environ.get(k, "").upper() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f in ("1", "ON", "YES", "TRUE") for f in flags) or bool(
        datasets.config.HF_HUB_OFFLINE
    )


_HUB_PROBE_TIMEOUT_S = 3.0


def _first_hop(endpoint: str) -> tuple[str | None, int]:
    """``(host, port)`` a request to ``endpoint`` connects to: its proxy if one applies
    (whose URL may name no host)."""
    url = urllib.parse.urlsplit(endpoint)
    if not url.hostname:
        raise ValueError("no host name")
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(url.hostname):
        url = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


def _hub_unreachable() -> str | None:
    """Why the hub (``HF_ENDPOINT``) cannot be reached, or ``None`` when it can.

    A TCP connect to the endpoint or its proxy, given ``_HUB_PROBE_TIMEOUT_S`` seconds in
    all: it runs in a daemon thread because a name lookup has no timeout of its own.
    """
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    try:
        host, port = _first_hop(endpoint)
    except ValueError as e:
        return f"HF_ENDPOINT '{endpoint}' is not a usable URL: {e}"
    failures: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=_HUB_PROBE_TIMEOUT_S).close()
            failures.append(None)
        except OSError as e:
            failures.append(f"{type(e).__name__}: {e}")

    probe = threading.Thread(target=connect, name="hub-probe", daemon=True)
    probe.start()
    probe.join(_HUB_PROBE_TIMEOUT_S)
    if not failures:
        return f"no connection to {endpoint} ({host}:{port}) within {_HUB_PROBE_TIMEOUT_S:g} s"
    return failures[0] and f"cannot connect to {endpoint} ({host}:{port}): {failures[0]}"


def load_hub_dataset(path: str, *, name: str | None, split: str):
    """A streaming dataset from the Hub; any failure becomes a one-line ``AssetError``.

    The hub is probed first, so that offline a run fails in seconds rather than after
    ``load_dataset``'s retries.
    """
    import datasets

    def no_hub(reason: str) -> AssetError:
        reason = " ".join(reason.split())[:300]
        return AssetError(
            f"cannot load '{path}' from the Hugging Face Hub ({reason}); no hub access: use "
            "--training.dataset titan_corpus (ships with the repo) or --training.dataset_path "
            "<local .jsonl/.json/.parquet/.txt file or folder>"
        )

    if _hub_offline():
        raise no_hub("offline mode is set by HF_HUB_OFFLINE/HF_DATASETS_OFFLINE")
    unreachable = _hub_unreachable()
    if unreachable:
        raise no_hub(unreachable)
    try:
        return datasets.load_dataset(path, name=name, split=split, streaming=True)
    except Exception as e:  # connection, auth, missing repo: all mean "not usable here"
        raise no_hub(f"{type(e).__name__}: {e}") from e
