"""The persistent Mamba-2 decode stack (one launch a step) == the three-kernel stack bit for bit and the op-by-op
reference, under the interpreter (one program: its barriers pass at once; several programs: one phase a launch),
and its sm_90 PTX: what other programs wrote loaded past L1, the weights in 16-byte loads."""

from __future__ import annotations

import json
import os
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
from tests.kernels.test_mamba_decode_persistent import load_lines, ptx_loads, source_key, ttir_loads
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


COMPILE_SCRIPT = """
import json, sys
from tests.kernels.compile_for_sm90 import mamba2_persistent_asm
print(json.dumps(mamba2_persistent_asm(sys.argv[1])))
"""


@pytest.mark.parametrize("act", ["*fp32", "*bf16"])
def test_sm90_loads_of_other_programs_writes_bypass_l1_and_weights_load_16_bytes(act):
    """Compiled for sm_90 (batch 1, mamba2-370m sizes): every load written with a ``cache_modifier`` (what an earlier
    phase wrote: in_proj's input rows, stream and out_proj output; x, B, C, dt and z; the sums of squares and the
    gated y; the final norm's stream and input) and only those bypass L1 (TTIR, whose lines are exact;
    ``ld.global.cg`` in the PTX), and every GEMV weight tile, from an address loaded from the table, is an
    ``ld.global.v4`` (without ``tl.multiple_of`` on the addresses they are single 16-bit loads)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, act], env=env, capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    if result.returncode != 0 and "ptxas" in result.stderr:
        pytest.skip("triton's NVIDIA backend tools are not installed")
    assert result.returncode == 0, result.stderr[-3000:]
    asm = json.loads(result.stdout)
    mamba1 = ROOT / "kernels" / "mamba_decode" / "fused_recurrent.py"
    files = (ROOT / "kernels" / "mamba2_decode" / "fused_recurrent.py", mamba1,
             ROOT / "kernels" / "residual_rms_norm" / "fused.py")
    modified = {(source_key(path), n) for path in files for n in load_lines(path, cache_modifier=True)}
    loads = ttir_loads(asm["ttir"])
    bypassing = {where for where, bypass in loads if bypass}
    assert bypassing and bypassing <= modified
    assert not any(where in modified for where, bypass in loads if not bypass)
    lines = {line for (path, line) in bypassing if path == source_key(mamba1)}
    inputs = {n for f in ("normed_input_times_weight", "gemv_input_tile") for n in load_lines(mamba1, f, True)}
    assert lines == inputs, lines  # in_proj's input: the rows, or the stream and out_proj's output
    (tile,) = load_lines(mamba1, "weight_tile")
    # This Triton's PTX places the tiles' loads up to three lines past the call (no other load is there).
    tiles = [op for (path, line), op in ptx_loads(asm["ptx"])
             if path == source_key(mamba1) and tile <= line <= tile + 3]
    assert len(tiles) >= 8 and all(op.startswith("ld.global.v4.") for op in tiles), tiles
