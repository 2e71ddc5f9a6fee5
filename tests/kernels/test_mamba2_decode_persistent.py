"""The persistent Mamba-2 decode stack (one launch a step) == the three-kernel stack bit for bit and the op-by-op
reference, under the interpreter (one program: its barriers pass at once; several programs: one phase a launch),
and its sm_90 PTX: what other programs wrote loaded past L1, the weights in 16-byte loads."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba2 import Mamba2Config, Mamba2LM
from tests.kernels.kernel_cases import count_calls, twin_pools
from tests.kernels.test_mamba2_decode_triton import (
    D_MODEL,
    D_STATE,
    GROUPS,
    HEAD_DIM,
    HEADS,
    reference_stack,
    stack_args,
)
from tests.kernels.test_mamba_decode_triton import assert_near

ROOT = Path(__file__).resolve().parents[2]
EPS = 1e-5
DT_LIMITS = (1e-3, 0.05)


def step_inputs(dtype: torch.dtype, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's normed input (weights' dtype) and fp32 residual stream."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, D_MODEL, generator=g).to(dtype), torch.randn(batch, D_MODEL, generator=g)


def run(stack, args: dict, normed: torch.Tensor, stream: torch.Tensor, **kwargs) -> torch.Tensor:
    return stack(normed, stream, args["norm_weights"], EPS, args["layers"], args["conv_pool"], args["ssm_pool"],
                 args["slot_ids"], GROUPS, EPS, DT_LIMITS, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2, 4])
@torch.inference_mode()
def test_one_program_equals_the_three_kernel_stack_and_the_reference(triton_on_cpu, dtype, batch) -> None:
    """Two steps with one program, the whole flow (pointer table, every barrier, the final norm): outputs and
    pools equal the three-kernel stack's bit for bit, and the reference's within the stack tests' tolerances;
    slots outside the batch untouched."""
    from rnnserve.kernels.mamba2_decode.fused_recurrent import mamba2_decode_stack_triton
    from rnnserve.kernels.mamba2_decode.persistent import mamba2_decode_stack_persistent

    ours, theirs = stack_args(dtype, batch, True), stack_args(dtype, batch, True)
    ref_pools = {name: theirs[name].clone() for name in ("conv_pool", "ssm_pool")}
    conv_before = ours["conv_pool"].clone()
    for step in range(2):
        normed, stream = step_inputs(dtype, batch, 10 + step)
        out = run(mamba2_decode_stack_persistent, ours, normed, stream)
        expected = run(mamba2_decode_stack_triton, theirs, normed, stream)
        assert out.dtype == dtype and torch.equal(out, expected)
        reference = reference_stack(normed, stream, ours["norm_weights"], EPS, ours["layers"], ref_pools["conv_pool"],
                                    ref_pools["ssm_pool"], ours["slot_ids"], DT_LIMITS)  # fmt: skip
        assert_near(out, reference, dtype)
    for name in ("conv_pool", "ssm_pool"):
        assert torch.equal(ours[name], theirs[name])
        assert_near(ours[name], ref_pools[name], dtype)
    untouched = torch.ones(conv_before.shape[0], dtype=torch.bool)
    untouched[ours["slot_ids"]] = False
    assert torch.equal(ours["conv_pool"][untouched], conv_before[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_several_programs_striding_over_each_phase(triton_on_cpu, dtype) -> None:
    """Each (layer, phase) launched alone with 3 programs (PHASE, barriers compiled out), so each program strides
    over several items of every phase: the same output and pools as one program running the whole step."""
    from rnnserve.kernels.mamba2_decode.persistent import FINAL_PHASE, mamba2_decode_stack_persistent, persistent_launch

    batch = 2
    ours, theirs = stack_args(dtype, batch, False), stack_args(dtype, batch, False)
    normed, stream = step_inputs(dtype, batch, 3)
    launch = persistent_launch(normed, stream, ours["norm_weights"], EPS, ours["layers"], ours["conv_pool"],
                               ours["ssm_pool"], ours["slot_ids"], GROUPS, EPS, DT_LIMITS)  # fmt: skip
    for layer in range(len(ours["layers"])):
        for phase in range(3):
            launch.run(3, phase, layer)
    launch.run(3, FINAL_PHASE)
    expected = run(mamba2_decode_stack_persistent, theirs, normed, stream, programs=1)
    assert torch.equal(launch.out, expected)
    for name in ("conv_pool", "ssm_pool"):
        assert torch.equal(ours[name], theirs[name])


@torch.inference_mode()
def test_a_bias_in_some_layers_only_runs_the_three_kernel_stack(triton_on_cpu, monkeypatch) -> None:
    """The kernel takes a bias in every layer or in none; other stacks run the three kernels."""
    from rnnserve.kernels.mamba2_decode.persistent import mamba2_decode_stack_persistent, persistent_applies

    args = stack_args(torch.float32, 1, True)
    normed, stream = step_inputs(torch.float32, 1, 0)
    assert persistent_applies(normed, args["layers"], args["norm_weights"])
    args["layers"][1] = (*args["layers"][1][:9], None)
    assert not persistent_applies(normed, args["layers"], args["norm_weights"])
    calls = count_calls(monkeypatch, [("rnnserve.kernels.mamba2_decode.fused_recurrent",
                                       "mamba2_decode_stack_triton")])  # fmt: skip
    run(mamba2_decode_stack_persistent, args, normed, stream)
    assert calls == {"mamba2_decode_stack_triton": 1}


@torch.inference_mode()
def test_model_decode_runs_the_persistent_stack_when_on(triton_on_cpu, monkeypatch) -> None:
    """``PERSISTENT`` on: the model's decode step runs the persistent stack, with the three-kernel stack's logits
    and states bit for bit."""
    from rnnserve.kernels.mamba2_decode import fused_recurrent

    config = Mamba2Config(vocab_size=64, d_model=D_MODEL, n_layers=2, n_heads=HEADS, head_dim=HEAD_DIM,
                          d_state=D_STATE, n_groups=GROUPS, use_bias=True, dt_max_limit=0.08)  # fmt: skip
    model = Mamba2LM(config).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    pools = twin_pools(model, 5)
    decode = DecodeBatch.build([1, 7], [3, 1], [4, 4])
    calls = count_calls(monkeypatch, [("rnnserve.kernels.mamba2_decode.persistent",
                                       "mamba2_decode_stack_persistent")])  # fmt: skip
    monkeypatch.setattr(fused_recurrent, "PERSISTENT", True)
    persistent = model.decode(decode, pools[0].tensors)
    monkeypatch.setattr(fused_recurrent, "PERSISTENT", False)
    three_kernels = model.decode(decode, pools[1].tensors)
    assert calls == {"mamba2_decode_stack_persistent": 1}
    assert torch.equal(persistent, three_kernels)
    for name in pools[0].tensors:
        assert torch.equal(pools[0].tensors[name], pools[1].tensors[name])


PTX_SCRIPT = """
import json, sys
from tests.kernels.compile_for_sm90 import persistent_ptx
print(json.dumps(persistent_ptx(sys.argv[1])))
"""


def loads_by_source(ptx: str) -> list[tuple[str, str, str]]:
    """``(instruction, source file name, source statement)`` of each global load of ``ptx``, by its ``.loc``."""
    files = {index: path for index, path in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, flags=re.MULTILINE)}
    sources: dict[str, list[str]] = {}
    loads, where = [], None
    for line in ptx.splitlines():
        line = line.strip()
        loc = re.match(r"\.loc\s+(\d+)\s+(\d+)", line)
        if loc:
            where = (files.get(loc.group(1), ""), int(loc.group(2)))
        elif re.search(r"\bld\.global", line) and where is not None:
            path, number = where
            if path not in sources:
                sources[path] = Path(path).read_text().splitlines() if Path(path).is_file() else []
            loads.append((line, "/".join(Path(path).parts[-2:]), statement_at(sources[path], number)))
    return loads


def statement_at(lines: list[str], number: int) -> str:
    """The source from line ``number`` (1-based) to where its parentheses close."""
    statement = ""
    for text in lines[number - 1:]:
        statement += " " + text.strip()
        if statement.count("(") <= statement.count(")"):
            break
    return statement


@pytest.mark.parametrize("act", ["*fp32", "*bf16"])
def test_sm90_ptx_loads_other_programs_writes_past_l1_and_weights_in_16_bytes(act):
    """In the persistent kernel's sm_90 PTX (batch 1, mamba2-370m sizes), each load placed by its ``.loc``: the
    loads the items make with their ``CACHE`` modifier (what an earlier phase wrote: x, B, C, dt and z, the sums
    of squares, the gated y; the stream and out_proj's output in the final norm) are ``ld.global.cg``, and every
    GEMV weight tile load (``weight_tile``, from a pointer loaded from the table) a 16-byte ``v4`` load. (The
    scheduler places some loads' ``.loc`` on a neighbouring line or on line 0, so the check names the statements it
    finds.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", PTX_SCRIPT, act], env=env, capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    if result.returncode != 0 and "ptxas" in result.stderr:
        pytest.skip("triton's NVIDIA backend tools are not installed")
    assert result.returncode == 0, result.stderr[-3000:]
    loads = loads_by_source(json.loads(result.stdout))
    cached = [load for load in loads if "cache_modifier=CACHE" in load[2]]
    assert all(".cg." in instruction for instruction, _, _ in cached), cached
    found = {statement.split("=")[0].strip() for _, _, statement in cached}
    assert {"x", "B", "C", "z", "squares"} <= found, found
    final_norm = [load for load in loads
                  if load[1] == "residual_rms_norm/fused.py" and load[2].strip() and "weight_ptr" not in load[2]]
    assert final_norm and all(".cg." in instruction for instruction, _, _ in final_norm), final_norm
    # The weight tiles' loads, some placed on line 0 of the helpers' file (none else is there).
    weights = [load for load in loads if load[1] == "mamba_decode/fused_recurrent.py"
               and ("tl.load(w_ptr + outs[:, None]" in load[2] or not load[2].strip())]
    assert len(weights) >= 8 and all(".v4." in instruction for instruction, _, _ in weights), weights
