"""Seeded differential checks of the API's answers (see ``api_invariants.py``) over several models, and the
minimised regressions of the violations they found. ``RNNSERVE_INVARIANT_CASES=N`` runs N cases per model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.server.api_invariants import COMPLETIONS, Case, ask, run_cases, served
from tests.server.tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)

CASES = int(os.environ.get("RNNSERVE_INVARIANT_CASES", "0"))


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("hf-tiny"))


@pytest.fixture(scope="module", params=["random:mingru-tiny", "default", "hf", "random:mamba-tiny"])
def model_client(request: pytest.FixtureRequest, hf_checkpoint: Path) -> Iterator[tuple[str, TestClient]]:
    model = {"default": None, "hf": str(hf_checkpoint)}.get(request.param, request.param)
    # Mamba on a pool smaller than the busy batch, with short prefill chunks: queued and chunked requests too.
    options = {"max_num_seqs": 3, "max_num_batched_tokens": 16} if request.param == "random:mamba-tiny" else {}
    with served(model, **options) as client:
        yield request.param, client


# Cases per model: a few hundred in all, within a minute on two cores.
DEFAULT_CASES = {"random:mingru-tiny": 140, "default": 60, "hf": 100, "random:mamba-tiny": 50}


def test_answers_keep_their_invariants(model_client: tuple[str, TestClient]) -> None:
    name, client = model_client
    report = run_cases(client, range(CASES or DEFAULT_CASES[name]), sessions=3)
    assert not report.violations, "\n".join(report.violations[:20])


@pytest.mark.parametrize("stream", [False, True])
def test_echo_places_the_generated_tokens_after_a_prompt_that_ends_inside_a_character(
    client: TestClient, stream: bool
) -> None:
    """The echoed prompt is decoded on its own (its last byte, a character's first, becomes U+FFFD), so the
    generated tokens' offsets start after that character, where their text starts, and not inside the prompt."""
    case = Case(0, COMPLETIONS, {"prompt": [62, 195], "max_tokens": 4, "temperature": 0, "logprobs": 0,
                                 "ignore_eos": True})  # fmt: skip
    plain = ask(client, case, stream).choices[0]
    echoed = ask(client, case, stream, echo=True).choices[0]
    assert echoed.text == ">\ufffd" + plain.text
    assert echoed.text_offset == [0, 1] + [2 + offset for offset in plain.text_offset or []]
