"""Resolve a Hugging Face repo id (``org/name[@revision]``) to a snapshot folder in the local HF cache.

Never downloads: the lookup is ``huggingface_hub``'s own, offline (``snapshot_download(local_files_only=True)``:
refs, branches, tags and commit hashes resolve as the hub resolves them). ``huggingface_hub`` is imported only
here, when a repo id is actually looked up, so importing the engine stays cheap.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+(@[\w.\-/]+)?$")


class HFCacheMiss(LookupError):
    """The repo (or revision) is not in the local cache; the message names the folder looked in."""


def hf_cache_dir() -> Path:
    """The hub cache folder, by the hub's precedence: ``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
    ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``. Read from the environment at each
    call: ``huggingface_hub.constants`` fixes it when the hub is first imported, which may be before a caller
    (a test, an embedding application) sets these variables."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def looks_like_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hugging Face repo id (``org/name[@revision]``), not of a path."""
    return bool(REPO_ID.match(name)) and not name.startswith((".", "/", "~"))


def resolve_repo_id(name: str, cache_dir: Path | None = None) -> Path:
    """``org/name`` or ``org/name@revision`` -> its snapshot folder; raises :class:`HFCacheMiss`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.file_download import repo_folder_name

    repo_id, _, revision = name.partition("@")
    cache_dir = cache_dir or hf_cache_dir()
    try:
        return Path(snapshot_download(repo_id, revision=revision or None, cache_dir=cache_dir, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError):
        repo_dir = cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
    if not repo_dir.is_dir():
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes", "on"}
        hint = "" if offline else " (rnnserve never downloads: fetch it first, e.g. `hf download`)"
        raise HFCacheMiss(
            f"{repo_id!r} is not a local directory nor in the local Hugging Face cache: "
            f"{repo_dir} does not exist{hint}"
        )
    raise HFCacheMiss(f"{repo_id!r}: revision {revision or 'main'!r} is not in the local cache ({repo_dir})")
