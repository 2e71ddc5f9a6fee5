"""lm-evaluation-harness end to end: its ``local-completions`` model runs a multiple-choice task and a
``loglikelihood_rolling`` perplexity task (tiny local tasks defined here) against a real ``rnnserve serve``
process, finding the server's tokenizer through ``/tokenizer_info`` on its own; the loglikelihoods it
received equal the offline engine's prompt logprobs.

lm-eval lives in its own environment (``build/lm-eval-venv``, pinned version), created by the first run of
this test (about a minute, from PyPI); the test is skipped, saying why, where it cannot be installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rnnserve import LLM, SamplingParams
from rnnserve.engine.tokenizer import Tokenizer
from tests.server.server_process import REPO, running_server
from tests.server.tiny_checkpoint import EOS, write_tiny_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

LM_EVAL = "lm-eval[api]==0.4.13"
VENV = REPO / "build" / "lm-eval-venv"
SERVED_NAME = "tiny"

QUESTIONS = [
    {"question": "The capital of France is", "choices": ["Paris", "Rome", "a fox"], "answer": 0},
    {"question": "Water boils at one hundred", "choices": ["degrees.", "dogs.", "states."], "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog.", "capital.", "model"], "answer": 0},
]
DOCUMENTS = [
    {"text": "A recurrent model keeps a state of constant size."},
    {"text": "Rome is the capital of Italy. The lazy dog sleeps."},
]
MC_TASK = """task: rnnserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
PPL_TASK = """task: rnnserve_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    """The ``lm_eval`` command of the test's own environment, installed on first use."""
    command, done = VENV / "bin" / "lm_eval", VENV / ".installed"
    if not done.exists():
        shutil.rmtree(VENV, ignore_errors=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, capture_output=True, timeout=120)
            pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
            subprocess.run([*pip, LM_EVAL], check=True, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.SubprocessError) as err:
            shutil.rmtree(VENV, ignore_errors=True)
            detail = getattr(err, "stderr", "") or ""
            pytest.skip(f"cannot install {LM_EVAL} into {VENV}: {err} {detail[-500:]}")
        done.touch()
    return command


def write_tasks(folder: Path) -> None:
    for name, task, rows in [("mc", MC_TASK, QUESTIONS), ("ppl", PPL_TASK, DOCUMENTS)]:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / f"{name}.yaml").write_text(task.format(data=data))


def lm_eval_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The token ids lm-eval sends for a (context, continuation) request: trailing spaces of the context move to
    the continuation, whose ids are the whole text's beyond the context's."""
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole, head = tokenizer.encode(stripped + continuation), tokenizer.encode(stripped)
    return head, whole[len(head) :]


def read_samples(output: Path, task: str) -> list[dict]:
    [path] = output.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lm_eval_loglikelihoods_equal_the_engine_prompt_logprobs(lm_eval: Path, tmp_path: Path) -> None:
    checkpoint = write_tiny_checkpoint(tmp_path / "model")
    tasks, output = tmp_path / "tasks", tmp_path / "out"
    tasks.mkdir()
    write_tasks(tasks)
    flags = ("--model", str(checkpoint), "--served-model-name", SERVED_NAME, "--max-num-seqs", "4")
    with running_server(*flags) as server:
        model_args = f"model={SERVED_NAME},base_url={server.url}/v1/completions,num_concurrent=2,max_retries=1"
        command = [
            str(lm_eval), "--model", "local-completions", "--model_args", model_args,
            "--tasks", "rnnserve_mc,rnnserve_ppl", "--include_path", str(tasks),
            "--output_path", str(output), "--log_samples",
        ]  # fmt: skip
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "remote tokenizer" in run.stderr + run.stdout  # found through /tokenizer_info, no Hugging Face hub

    llm = LLM(str(checkpoint), device="cpu", max_num_seqs=4)
    tokenizer = llm.tokenizer
    eos_id = tokenizer.encode(EOS)[0]
    assert eos_id == tokenizer.eos_token_id
    received: list[float] = []
    prompts: list[list[int]] = []
    scored_from: list[int] = []
    for sample in read_samples(output, "rnnserve_mc"):
        doc = sample["doc"]
        assert len(sample["resps"]) == len(doc["choices"])
        for choice, resp in zip(doc["choices"], sample["resps"], strict=True):
            head, tail = lm_eval_pair(tokenizer, doc["question"], " " + choice)
            prompts.append(head + tail)
            scored_from.append(len(head))
            received.append(float(resp[0][0]))
    for sample in read_samples(output, "rnnserve_ppl"):
        prompts.append([eos_id, *tokenizer.encode(sample["doc"]["text"])])  # one window: the prefix token, the text
        scored_from.append(1)
        received.append(float(sample["resps"][0][0]))
    assert len(received) == sum(len(q["choices"]) for q in QUESTIONS) + len(DOCUMENTS)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    expected = [
        sum(entry.logprob for entry in out.prompt_logprobs[start:])  # type: ignore[union-attr, index]
        for out, start in zip(outputs, scored_from, strict=True)
    ]
    assert received == pytest.approx(expected, abs=1e-4)
    results = json.loads(next(output.rglob("results_*.json")).read_text())["results"]
    assert "acc,none" in results["rnnserve_mc"] and "word_perplexity,none" in results["rnnserve_ppl"]
