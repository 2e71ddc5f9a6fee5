"""Compiled LSRL models through the model interface, checkpoints, the CLI, the offline engine and HTTP."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from rnnserve.engine import LLM, SamplingParams
from rnnserve.engine.loader import load_model, save_checkpoint
from rnnserve.engine.lsrl.cli import main as lsrl_main
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch
from rnnserve.engine.state_pool import StatePool
from rnnserve.engine.tokenizer import CharTokenizer
from rnnserve.server.app import ServerConfig, create_app
from tests.lsrl.conftest import APPROXIMATOR, CAN_OUTPUTS, CELLS, MAJORITY, PAIRS, model_outputs

GREEDY7 = SamplingParams(temperature=0, max_tokens=7)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lsrl" / "majority.py"


def test_state_holds_only_persistent_dimensions(builtin) -> None:
    model, _ = builtin["dictionary"]
    (spec,) = model.state_spec()
    layers = model._linstates()
    assert spec.dtype == torch.float64 and spec.shape == (sum(len(la.persistent) for la in layers),)
    assert spec.shape[0] < sum(la.init_state.numel() for la in layers)  # bypass lanes are not stored
    assert torch.equal(spec.initial, torch.cat([la.init_state[la.persistent] for la in layers]))


def test_prefill_chunked_prefill_and_decode_agree(builtin) -> None:
    model, tokenizer = builtin["dictionary"]
    ids = tokenizer.encode("CAN" + PAIRS)
    pool = StatePool(model.state_spec(), 3)
    whole, chunked, stepped = pool.allocate(3)
    logits_whole = model.prefill(PrefillBatch.build([ids], [whole]), pool.tensors)
    for start in range(0, len(ids), 5):
        batch = PrefillBatch.build([ids[start : start + 5]], [chunked], [start])
        logits_chunked = model.prefill(batch, pool.tensors)
    for position, token in enumerate(ids):
        logits_stepped = model.decode(DecodeBatch.build([token], [stepped], [position]), pool.tensors)
    state = pool.tensors["state"]
    assert torch.allclose(state[chunked], state[whole], rtol=0, atol=1e-9)
    assert torch.allclose(state[stepped], state[whole], rtol=0, atol=1e-9)
    for logits in (logits_whole, logits_chunked, logits_stepped):
        assert logits.dtype == torch.float64 and int(logits.argmax()) == 20  # T


def test_head_is_nearest_integer_and_skips_valueless_tokens(builtin) -> None:
    model, tokenizer = builtin["approximator"]
    logits = model.logits(torch.tensor([2.4, 2.6, -5.0, 42.0], dtype=torch.float64))
    assert logits.argmax(dim=-1).tolist() == [2, 3, 0, 9]
    assert torch.isinf(logits[:, tokenizer.encode("(0.5,0.5)")]).all()


def test_head_picks_the_nearest_value_for_outputs_far_outside_the_values(builtin) -> None:
    """A program whose state grows without bound (``A = [[2]]``) outputs 1e20 and then inf: the squared distances
    to every value rounded to one number (1e20) or to NaN (inf), and greedy decoding returned token 0, the farthest,
    instead of the largest value."""
    model, _ = builtin["approximator"]
    for dtype in (torch.float64, torch.float32):
        y = torch.tensor([1e20, float("inf"), 3e38, -1e20, -float("inf"), 9.6, -0.4], dtype=dtype)
        logits = copy.deepcopy(model).to(dtype).logits(y)
        assert logits.argmax(dim=-1).tolist() == [9, 9, 9, 0, 0, 9, 0]
        assert not torch.isnan(logits).any()


def test_checkpoint_round_trip_and_fp32_selection(builtin, tmp_path: Path) -> None:
    model, _ = builtin["dictionary"]
    save_checkpoint(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architecture"] == "lsrl" and config["alphabet"][:3] == [".", "A", "B"]
    loaded, tokenizer = load_model(str(tmp_path), device="cpu")
    assert isinstance(tokenizer, CharTokenizer) and loaded.embedding.dtype == torch.float64
    ids = tokenizer.encode("CAN" + PAIRS)
    assert torch.equal(model_outputs(loaded, ids), model_outputs(model, ids))
    loaded32, _ = load_model(str(tmp_path), device="cpu", dtype="fp32")
    assert loaded32.embedding.dtype == torch.float32 and loaded32.state_spec()[0].dtype == torch.float32
    assert loaded32.layers[0].A.indices.dtype == torch.int64


def test_cli_compiles_a_program_file_that_the_engine_serves(tmp_path: Path, capsys) -> None:
    assert lsrl_main(["compile", str(EXAMPLE), "-o", str(tmp_path / "majority")]) == 0
    assert "1 LinState layer(s)" in capsys.readouterr().out
    llm = LLM(str(tmp_path / "majority"), device="cpu", max_num_seqs=4)
    text, expected = MAJORITY[0]
    outputs = llm.generate([text[: i + 1] for i in range(len(text))], SamplingParams(temperature=0, max_tokens=1))
    assert [o.outputs[0].text for o in outputs] == [str(v) for v in expected]


VECTOR_PROGRAM = """
from rnnserve.engine.lsrl import Input, LinState

ALPHABET = ["0", "1", "2", "3", "4", "5", "a+", "b+"]
EMBEDDING = [[0, 0]] * 6 + [[1, 0], [0, 2]]  # digits change nothing, a+ adds 1, b+ adds 2
VALUES = [0, 1, 2, 3, 4, 5, None, None]


def build():
    x = Input(2)
    return LinState(x[0] + x[1], A=[[1]], B=[[1]])
"""


def test_cli_compiles_a_vector_input_program_with_its_embedding(tmp_path: Path) -> None:
    (tmp_path / "total.py").write_text(VECTOR_PROGRAM)
    assert lsrl_main(["compile", str(tmp_path / "total.py"), "-o", str(tmp_path / "total")]) == 0
    llm = LLM(str(tmp_path / "total"), device="cpu")
    outputs = llm.generate(["a+b+", "b+b+a+", "a+"], SamplingParams(temperature=0, max_tokens=3))
    assert [o.outputs[0].text for o in outputs] == ["333", "555", "111"]


def test_cli_reports_bad_program_files(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    assert lsrl_main(["compile", str(bad), "-o", str(tmp_path / "out")]) == 1
    assert "define build()" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["compile", "run"])
def test_cli_names_a_program_whose_inputs_form_a_cycle(tmp_path: Path, capsys, command: str) -> None:
    """``lsrl run`` failed with a KeyError traceback, ``lsrl compile`` with "compiling it raised KeyError: 3"."""
    program = tmp_path / "cycle.py"
    program.write_text("from rnnserve.engine.lsrl import Input, Lin, ReLU\n\ndef build():\n    x = Input(1)\n"
                       "    a = Lin(x, [[1.0]])\n    b = Lin(ReLU(a), [[2.0]])\n    a.inputs = (b,)\n    return b\n")
    args = [command, str(program), *(["-o", str(tmp_path / "out")] if command == "compile" else ["1"])]
    assert lsrl_main(args) == 1
    err = capsys.readouterr().err
    assert f"{program}: build() returned no valid program: an LSRL program is a DAG, but the inputs of 3 node(s) " \
           "form a cycle: Lin#" in err and len(err.strip().splitlines()) == 1  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("program", "message"),
    [
        ("ALPHABET = [1, 2]\ndef build():\n    return Input(1)\n", "token strings must be strings"),
        ("ALPHABET = 'ab'\nEMBEDDING = [[0], [1]]\nVALUES = [None, None]\ndef build():\n    return Input(1)\n",
         "at least one token needs a value"),
        ("def build():\n    x = Input(1)\n    return Lin(x, [[float('nan')]])\n", "holds NaN or infinite numbers"),
        ("class Own(Node):\n    pass\ndef build():\n    return Own(1, [Input(1)])\n", "unknown LSRL node"),
    ],
)
def test_cli_refuses_programs_that_would_serve_wrongly(tmp_path: Path, capsys, program: str, message: str) -> None:
    """Each compiled (or crashed with a traceback), then failed to load or served tokens it should not."""
    (tmp_path / "p.py").write_text("from rnnserve.engine.lsrl import Input, Lin\nfrom rnnserve.engine.lsrl.program "
                                   "import Node\n" + program)  # fmt: skip
    assert lsrl_main(["compile", str(tmp_path / "p.py"), "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_imports_a_program_as_python_runs_it(tmp_path: Path) -> None:
    """A @dataclass under `from __future__ import annotations` and an import of a sibling module failed."""
    (tmp_path / "shapes.py").write_text("WIDTH = 1\n")
    (tmp_path / "p.py").write_text(
        "from __future__ import annotations\nfrom dataclasses import dataclass\nimport shapes\n"
        "from rnnserve.engine.lsrl import Input, LinState\n\n@dataclass\nclass Spec:\n    width: int\n\n"
        "def build():\n    return LinState(Input(Spec(shapes.WIDTH).width), A=[[1]], B=[[1]])\n"
    )
    assert lsrl_main(["compile", str(tmp_path / "p.py"), "-o", str(tmp_path / "out")]) == 0


def test_numpy_on_the_left_of_an_operator_builds_one_node() -> None:
    """`np.array([1, 2]) * x` gave an ndarray of nodes, which sum() folded into 3 x."""
    import numpy as np

    from rnnserve.engine.lsrl import Input
    from rnnserve.engine.lsrl.program import Node

    x = Input(2)
    for expression in (lambda: np.array([1.0, 2.0]) * x, lambda: np.array([1.0, 2.0]) + x):
        try:
            node = expression()
        except TypeError:
            continue  # refused, also right
        assert isinstance(node, Node)


def test_served_builtins_greedy_known_answers() -> None:
    llm = LLM("lsrl:majority", device="cpu", max_num_seqs=8, max_num_batched_tokens=4)
    for text, expected in MAJORITY:
        prefixes = [text[: i + 1] for i in range(len(text))]
        outputs = llm.generate(prefixes, SamplingParams(temperature=0, max_tokens=1))
        assert [o.outputs[0].token_ids[0] for o in outputs] == expected
    llm = LLM("lsrl:dictionary", device="cpu")
    (out,) = llm.generate(["CAN" + PAIRS], GREEDY7)
    assert out.outputs[0].text == "TOTTOTT" and out.outputs[0].token_ids[:1] == CAN_OUTPUTS[-1:]
    llm = LLM("lsrl:approximator", device="cpu")
    outputs = llm.generate([query + CELLS for query, _ in APPROXIMATOR], SamplingParams(temperature=0, max_tokens=3))
    assert [o.outputs[0].text for o in outputs] == [str(expected[-1]) * 3 for _, expected in APPROXIMATOR]


def test_http_completion_returns_the_dictionary_answer() -> None:
    app = create_app(ServerConfig.build(model="lsrl:dictionary", max_num_seqs=4))
    with TestClient(app) as client:
        body = {"model": "lsrl:dictionary", "prompt": "CAN" + PAIRS, "temperature": 0, "max_tokens": 7}
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "TOTTOTT"


def test_a_chat_request_is_a_400_on_messages_showing_the_rendered_prompt(tmp_path: Path) -> None:
    """The default template's ``User: ...`` is not in the alphabet: the 400 named ``prompt``, a field a chat request
    does not have, and quoted ``'ser: CANAUS'`` without saying where that text came from."""
    body = {"messages": [{"role": "user", "content": "CAN" + PAIRS}], "max_tokens": 3, "temperature": 0}
    with TestClient(create_app(ServerConfig.build(model="lsrl:dictionary", max_num_seqs=4))) as client:
        for stream in (False, True):
            response = client.post("/v1/chat/completions", json={**body, "stream": stream})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error.keys() == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["param"] == "messages"
            assert error["message"].startswith("the chat template renders the messages as 'User: CANAUSVIE")
            assert "no symbol of this model's alphabet starts at 'ser: CANAUSV'" in error["message"]
            assert "/v1/completions" in error["message"] and "--chat-template" in error["message"]
        tokens = client.post("/tokenize", json={"messages": body["messages"]})
        assert tokens.status_code == 400 and tokens.json()["error"]["param"] == "messages"
    (tmp_path / "plain.jinja").write_text("{{ messages[-1]['content'] }}")
    config = ServerConfig.build(model="lsrl:dictionary", max_num_seqs=4, chat_template=str(tmp_path / "plain.jinja"))
    with TestClient(create_app(config)) as client:
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "TOT"


def test_sampling_at_the_default_temperature_gives_the_programs_answer() -> None:
    """At unit scale the head let temperature 1 (OpenAI's default) pick a neighbour of the answer: a sampled
    8-token dictionary answer was right about 1% of the time."""
    llm = LLM("lsrl:dictionary", max_num_seqs=4)
    [greedy] = llm.generate("CAN" + PAIRS, SamplingParams(temperature=0, max_tokens=8))
    sampled = llm.generate(["CAN" + PAIRS] * 8, [SamplingParams(max_tokens=8, seed=s) for s in range(8)])
    assert {out.outputs[0].text for out in sampled} == {greedy.outputs[0].text}
