"""Resolve a Hugging Face repo id (``org/name[@revision]``) to a snapshot folder in the local HF cache.

Never downloads: rnnserve reads what ``huggingface_hub`` already stored. The cache root follows the hub's
rules: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
``~/.cache/huggingface/hub``. A repo lives in ``models--org--name/`` with ``refs/<revision>`` holding a commit
hash and ``snapshots/<commit>/`` the files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")


class HFCacheMiss(LookupError):
    """The repo (or revision) is not in the local cache; the message names the folder looked in."""


def hf_cache_dir() -> Path:
    """The hub cache folder from the environment (the same precedence as ``huggingface_hub``)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def looks_like_repo_id(name: str) -> bool:
    return bool(REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def resolve_repo_id(name: str, cache_dir: Path | None = None) -> Path:
    """``org/name`` or ``org/name@revision`` -> its snapshot folder; raises :class:`HFCacheMiss`."""
    repo_id, _, revision = name.partition("@")
    revision = revision or "main"
    cache_dir = cache_dir or hf_cache_dir()
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
    hint = "" if offline else " (rnnserve never downloads: fetch it first, e.g. `huggingface-cli download`)"
    if not repo_dir.is_dir():
        raise HFCacheMiss(
            f"{repo_id!r} is not a local directory nor in the local Hugging Face cache: "
            f"{repo_dir} does not exist{hint}"
        )
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        raise HFCacheMiss(
            f"{repo_id!r}: revision {revision!r} is not in the local cache ({snapshot} does not exist)"
        )
    return snapshot
