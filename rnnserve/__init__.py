"""rnnserve: inference serving for recurrent language models.

The repository keeps its folders at the top level (``engine/``, ``kernels/``, ``server/``, ``clients/``); they
are installed as ``rnnserve.engine``, ``rnnserve.kernels``, ``rnnserve.server`` and ``rnnserve.clients``
(setuptools ``package-dir`` in ``pyproject.toml``). Run from a source checkout without installing (e.g.
``PYTHONPATH=.``), this package also looks for them beside this folder.
"""

from pathlib import Path as _Path
from typing import TYPE_CHECKING

_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "engine").is_dir() and (_checkout / "engine" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # type: ignore[name-defined]  # noqa: F821

if TYPE_CHECKING:
    from rnnserve.engine import LLM, CompletionOutput, RequestOutput, SamplingParams, StructuredOutputParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> object:
    """The engine's public names, imported on first use: ``rnnserve.clients`` (the HTTP client and load
    generator) then runs without importing torch (``rnnserve bench``'s client processes start in 0.3 s, not 3)."""
    if name in __all__:
        from rnnserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'rnnserve' has no attribute {name!r}")
