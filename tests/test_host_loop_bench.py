"""``benchmarks/host_loop.py`` on tiny presets: one row per preset and output kind, the engine never faster than
the model step it wraps by more than noise, and the profile printed on request. Its ratios are not checked
(timing belongs in the benchmark); its plumbing is: every timed step decodes the whole batch."""

from __future__ import annotations

import pytest
import torch

from benchmarks import host_loop
from rnnserve.engine.config import EngineConfig
from rnnserve.engine.llm_engine import LLMEngine
from rnnserve.engine.loader import build_random
from rnnserve.engine.sampling_params import OutputKind


def test_prints_one_row_per_preset_and_output_kind(capsys: pytest.CaptureFixture[str]) -> None:
    host_loop.main(["--presets", "mingru-tiny", "mamba-tiny", "--batch", "6", "--steps", "3", "--reps", "1",
                    "--threads", "1", "--profile"])  # fmt: skip
    out = capsys.readouterr().out
    assert "where 3 engine steps spend their time" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("mingru-tiny ", "mamba-tiny "))]
    assert [(r[0], r[1]) for r in rows] == [
        (preset, kind) for preset in ("mingru-tiny", "mamba-tiny") for kind in ("final_only", "delta", "cumulative")
    ]
    for row in rows:
        model_ms, engine_ms, host_ms, ratio = map(float, row[2:])
        assert model_ms > 0 and engine_ms > 0
        assert host_ms == pytest.approx(engine_ms - model_ms, abs=2e-3)
        assert ratio == pytest.approx(engine_ms / model_ms, rel=0.02, abs=0.01)


def test_a_batch_larger_than_the_slots_is_refused() -> None:
    model, tokenizer = build_random("mingru-tiny", torch.device("cpu"), torch.float32)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2))
    with pytest.raises(RuntimeError, match="not all decoding"):
        host_loop.start_decoding(engine, 4, OutputKind.DELTA, max_tokens=8)
