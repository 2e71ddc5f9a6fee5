"""The persistent Mamba-1 decode stack (one launch a step) == the three-kernel stack, bit for bit, under the
interpreter: one program (its barriers pass at once) through the whole flow, pointer tables included, and a launch
a phase of several programs (the items' striding); in its sm_90 PTX, the loads of what other programs wrote bypass
L1 and the weights' loads are 16-byte vectors."""

from __future__ import annotations

import ast
import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rnnserve.engine.models.base import DecodeBatch
from rnnserve.engine.models.mamba import MambaConfig, MambaLM
from rnnserve.kernels.mamba_decode import fused_recurrent, persistent
from rnnserve.kernels.mamba_decode.fused_recurrent import mamba_decode_stack_triton
from rnnserve.kernels.mamba_decode.persistent import mamba_decode_stack_persistent, persistent_grid, pointer_table
from tests.kernels.kernel_cases import count_calls, twin_pools
from tests.kernels.test_mamba_decode_triton import D_INNER, D_MODEL, assert_near, reference_stack, stack_args

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2  # decode steps a case runs: the second reads the conv tails and states the first wrote


def run_both(args: dict, **persistent_options: object) -> None:
    """``STEPS`` steps of the three-kernel stack and of the persistent one on copies of ``args``: outputs and
    pools equal bit for bit; the persistent stack's outputs and pools equal the op-by-op reference's to the
    three-kernel stack's tolerances."""
    ours, reference = copy.deepcopy(args), copy.deepcopy(args)
    dtype, batch = args["normed"].dtype, args["normed"].shape[0]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 + step)
        step_args = {"normed": torch.randn(batch, D_MODEL, generator=g).to(dtype),
                     "stream": torch.randn(batch, D_MODEL, generator=g).to(args["stream"].dtype)}
        three = mamba_decode_stack_triton(**{**args, **step_args})
        one = mamba_decode_stack_persistent(**{**ours, **step_args}, **persistent_options)
        expected = reference_stack(**{**reference, **step_args})
        assert one.dtype == three.dtype == dtype
        assert torch.equal(one, three)
        assert_near(one, expected, dtype)
    for pool in ("conv_pool", "ssm_pool"):
        assert torch.equal(ours[pool], args[pool])
        assert_near(ours[pool], reference[pool], dtype)


@pytest.mark.parametrize(("dtype", "stream_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("batch", [1, 2, 5])  # slots out of order with gaps; 5 rows: blocks of 8
@pytest.mark.parametrize("use_bias", [False, True])
@torch.inference_mode()
def test_one_program_equals_the_three_kernel_stack(triton_on_cpu, dtype, stream_dtype, batch, use_bias) -> None:
    run_both(stack_args(dtype, batch, use_bias, stream_dtype))


@pytest.mark.parametrize(("dtype", "batch", "use_bias"), [(torch.float32, 5, True), (torch.bfloat16, 2, False)])
@torch.inference_mode()
def test_a_launch_a_phase_of_three_programs_equals_the_three_kernel_stack(triton_on_cpu, dtype, batch,
                                                                           use_bias) -> None:
    """Three programs striding over each phase's items (in_proj's 6, the SSM's 2 a row, out_proj's 12, the final
    norm's rows), each (layer, phase) its own launch without barriers."""
    run_both(stack_args(dtype, batch, use_bias, torch.float32), phase_programs=3)


@torch.inference_mode()
def test_several_tiles_a_row_in_a_launch_a_phase(triton_on_cpu, monkeypatch) -> None:
    """Tiles smaller than a weight row (the loops past each GEMV's first tile) with the loads before the wait off,
    in launches of three programs."""
    monkeypatch.setattr(fused_recurrent, "TILE", 512)
    monkeypatch.setattr(fused_recurrent, "OUT_PROJ_TILE", 512)
    monkeypatch.setattr(fused_recurrent, "EARLY_LOADS", False)
    run_both(stack_args(torch.float32, 5, True, torch.float32), phase_programs=3)


@pytest.mark.parametrize("batch", [1, 2])
@torch.inference_mode()
def test_model_decode_runs_the_persistent_stack_when_chosen(triton_on_cpu, monkeypatch, batch) -> None:
    """``PERSISTENT`` set: the model's decode step runs the persistent launch, logits and states equal to the
    three-kernel stack's bit for bit."""
    config = MambaConfig(vocab_size=64, d_model=D_MODEL, n_layers=2, d_inner=D_INNER, dt_rank=3, use_bias=True)
    model = MambaLM(config).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    calls = count_calls(monkeypatch, [("rnnserve.kernels.mamba_decode.persistent", "mamba_decode_stack_persistent"),
                                      ("rnnserve.kernels.mamba_decode.fused_recurrent", "mamba_decode_stack_triton")])
    pools = twin_pools(model, batch + 3)
    decode = DecodeBatch.build(list(range(batch)), list(range(batch + 1, 1, -1)), [4] * batch)
    monkeypatch.setattr(fused_recurrent, "PERSISTENT", True)
    one = model.decode(decode, pools[0].tensors)
    monkeypatch.setattr(fused_recurrent, "PERSISTENT", False)
    three = model.decode(decode, pools[1].tensors)
    assert calls == {"mamba_decode_stack_persistent": 1, "mamba_decode_stack_triton": 1}
    assert torch.equal(one, three)
    for name in pools[0].tensors:
        assert torch.equal(pools[0].tensors[name], pools[1].tensors[name])


def test_pointer_table_is_built_once_per_set_of_tensors() -> None:
    weights = [torch.randn(4, 8) for _ in range(3)]
    norms = [torch.randn(8) for _ in range(3)]
    table = pointer_table([weights, norms])
    assert table.dtype == torch.int64 and table.tolist() == [[t.data_ptr() for t in c] for c in (weights, norms)]
    assert pointer_table([weights, norms]) is table
    assert pointer_table([norms, weights]) is not table


@pytest.mark.parametrize("bad", ["transposed", "misaligned"])
def test_pointer_table_refuses_what_the_kernels_cannot_load(bad: str) -> None:
    """The kernels index rows of a contiguous tensor and assume 16-byte aligned addresses."""
    base = torch.randn(8, 8)
    tensor = base.t() if bad == "transposed" else base.view(-1)[1:]
    with pytest.raises(ValueError, match="contiguous tensors on one device at 16-byte"):
        pointer_table([[base, tensor]])


@torch.inference_mode()
def test_layers_must_agree_on_biases_and_shapes() -> None:
    args = stack_args(torch.float32, 1, True, torch.float32)
    layers = args["layers"]
    layers[1] = (layers[1][0], None, *layers[1][2:])
    with pytest.raises(ValueError, match="biases in every layer or in none"):
        mamba_decode_stack_persistent(**args)
    layers[1] = (*layers[2][:9], layers[2][9][:, :-4].contiguous(), *layers[2][10:])
    with pytest.raises(ValueError, match="layers of one shape and dtype"):
        mamba_decode_stack_persistent(**args)


def test_persistent_grid_is_one_program_per_sm_at_most(monkeypatch) -> None:
    monkeypatch.setattr(persistent, "_sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert persistent_grid(cuda, 256) == 132 and persistent_grid(cuda, 40) == 40 and persistent_grid(cuda, 0) == 1
    assert persistent_grid(torch.device("cpu"), 256) == 1  # the interpreter: a barrier passes only for one program


COMPILE_SCRIPT = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tests.kernels.compile_for_sm90 import _specialize, mamba_persistent_configs
kernel, types, constexprs, num_warps = mamba_persistent_configs("*bf16")[0]
signature, constexprs, attrs = _specialize(kernel, types, constexprs)
names = kernel.arg_names
source = ASTSource(kernel, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
asm = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm
print(json.dumps({"ttir": asm["ttir"], "ptx": asm["ptx"]}))
"""


def load_lines(path: Path, function: str | None = None, cache_modifier: bool = False) -> set[int]:
    """Lines of ``path`` where a ``tl.load`` starts: within ``function`` only, or those with a ``cache_modifier``."""
    tree = ast.parse(path.read_text())
    if function is not None:
        tree = next(node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function)
    return {node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.load"
            and (not cache_modifier or any(k.arg == "cache_modifier" for k in node.keywords))}


def source_key(path: str | Path) -> str:
    """A kernel source file as ``kernels/<op>/<file>.py``: compiled modules name their files by the path they were
    first compiled from (Triton's cache serves another checkout's build of the same source)."""
    return "/".join(Path(path).parts[-3:])


def ttir_loads(ttir: str) -> list[tuple[tuple[str, int], bool]]:
    """``((file, line), bypasses L1)`` of each ``tt.load`` of a TTIR module (the line of the ``tl.load`` call,
    inlined functions' own lines)."""
    locs = dict(re.findall(r"^(#loc\d*) = (loc\(.*\))$", ttir, re.M))

    def place(ref: str) -> tuple[str, int]:
        text = locs[ref]
        if match := re.match(r'loc\("([^"]+)":(\d+):\d+\)', text):
            return source_key(match.group(1)), int(match.group(2))
        inner = re.match(r'loc\((?:callsite\()?(?:"[^"]*"\()?(#loc\d*)', text)
        return place(inner.group(1))

    return [(place(re.search(r"loc\((#loc\d*)\)\s*$", line).group(1)), "cache_modifier = cg" in line)
            for line in ttir.splitlines() if " tt.load " in line]


def ptx_loads(ptx: str) -> list[tuple[tuple[str, int], str]]:
    """``((file, line), instruction)`` of each ``ld.global`` of a PTX module, by the ``.loc`` before it."""
    files = {n: source_key(path) for n, path in re.findall(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', ptx, re.M)}
    loads, where = [], None
    for line in ptx.splitlines():
        if loc := re.match(r"\s*\.loc\s+(\d+)\s+(\d+)", line):
            where = (files[loc.group(1)], int(loc.group(2)))
        elif "ld.global" in line:
            loads.append((where, re.search(r"ld\.global\S*", line).group()))
    return loads


def test_sm90_loads_of_other_programs_writes_bypass_l1_and_weights_load_16_bytes():
    """Compiled for sm_90 at batch 1 in bf16: the loads written with ``cache_modifier=CACHE`` (the stream, out_proj's
    output, x, z, y, the partial sums; the final norm's stream and input) and only those bypass L1 (TTIR, whose
    lines are exact; ``ld.global.cg`` in the PTX), and the in_proj and out_proj weight tiles, from addresses loaded
    from the table, are ``ld.global.v4`` (16 bytes a thread; without ``tl.multiple_of`` on the addresses they are
    single bf16 loads)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    if result.returncode != 0 and "ptxas" in result.stderr:
        pytest.skip("triton's NVIDIA backend tools are not installed")
    assert result.returncode == 0, result.stderr[-3000:]
    asm = json.loads(result.stdout)
    stack = ROOT / "kernels" / "mamba_decode" / "fused_recurrent.py"
    norm = ROOT / "kernels" / "residual_rms_norm" / "fused.py"
    shared = {(source_key(path), n) for path in (stack, norm) for n in load_lines(path, cache_modifier=True)}
    assert len(shared) == 12
    loads = ttir_loads(asm["ttir"])
    assert {where for where, bypass in loads if bypass} == shared
    assert not any(where in shared for where, bypass in loads if not bypass)
    ptx = ptx_loads(asm["ptx"])
    assert {where[0] for where, op in ptx if ".cg." in op} == {source_key(stack), source_key(norm)}
    (tile,) = load_lines(stack, "weight_tile")
    tiles = [op for where, op in ptx if where == (source_key(stack), tile)]
    assert tiles and all(op.startswith("ld.global.v4.") for op in tiles), tiles
