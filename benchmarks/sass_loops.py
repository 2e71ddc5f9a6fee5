"""Instruction counts of the Triton kernels' loops as compiled for an H100 (sm_90), without a GPU.

A prefill kernel that walks tokens spends its time in one loop; with the multiprocessors' issue slots the limit
(as for the Mamba-1 scan, whose inputs are a few bytes per token and whose state stays in registers), fewer
instructions per iteration is a faster kernel. This compiles kernels as their wrappers launch them at the 370m
sizes (``tests/kernels/compile_for_sm90.py``: the same configurations, alignment hints and launch integers as the
spill check), disassembles them (``cuobjdump -sass``) and prints each kernel's registers and instructions, and
for every loop (a backward branch) its length and its special-function (``MUFU``), shuffle (``SHFL``) and
global-load (``LDG``) instructions. Counts are static: a branch inside a loop counts both of its sides.

    python benchmarks/sass_loops.py [--act bf16] [KERNEL ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Runs from a checkout without installing: rnnserve finds its folders beside rnnserve/.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # the interpreter's kernels cannot be compiled

import argparse  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402

import triton  # noqa: E402

from tests.kernels.compile_for_sm90 import _configs, compile_sm90, cuobjdump  # noqa: E402

PREFILL_KERNELS = ["_selective_scan_varlen_kernel", "_segment_state_kernel", "_conv_varlen_kernel",
                   "_conv_edges_kernel", "_ssd_chunk_state_kernel", "_ssd_chunk_scan_kernel"]  # fmt: skip
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


def sass_instructions(sass: str) -> list[tuple[int, str]]:
    """``(address, instruction)`` of every instruction in ``cuobjdump -sass`` output."""
    return [(int(address, 16), text) for address, text in _INSTRUCTION.findall(sass)]


def opcode(instruction: str) -> str:
    """The opcode without its predicate and modifiers: ``@!P2 FMUL.FTZ R1, ...`` -> ``FMUL``."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def loops(instructions: list[tuple[int, str]]) -> list[tuple[int, int, collections.Counter]]:
    """``(start, end, opcode counts)`` of each backward branch's body, in address order."""
    found = []
    for address, text in instructions:
        branch = _BRANCH.search(text)
        if branch and int(branch.group(1), 16) < address:
            start = int(branch.group(1), 16)
            body = [opcode(t) for a, t in instructions if start <= a <= address]
            found.append((start, address, collections.Counter(body)))
    return found


def compile_report(kernel: triton.JITFunction, types: dict, constexprs: dict, num_warps: int) -> dict:
    """Registers, instruction count and loops of one kernel configuration compiled for sm_90."""
    cubin, constexprs = compile_sm90(kernel, types, constexprs, num_warps)
    usage = cuobjdump(cubin, "-res-usage")
    instructions = sass_instructions(cuobjdump(cubin, "-sass"))
    flags = {k: v for k, v in constexprs.items() if isinstance(v, bool)}
    return {"kernel": kernel.__name__, "flags": flags, "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "instructions": len(instructions), "loops": loops(instructions)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", default=PREFILL_KERNELS, help="kernel names (default: the prefill "
                        "kernels of Mamba-1 and Mamba-2)")  # fmt: skip
    parser.add_argument("--act", choices=["bf16", "fp32"], default="bf16", help="activation dtype (default: bf16)")
    args = parser.parse_args(argv)
    configs = [c for c in _configs(f"*{args.act}") if c[0].__name__ in args.kernels]
    unknown = set(args.kernels) - {c[0].__name__ for c in configs}
    if unknown:
        parser.error(f"no compile configuration for {sorted(unknown)}")
    print(f"Triton {triton.__version__}, sm_90, {args.act} activations\n")
    print("| kernel | flags | registers | instructions | loop: instructions (MUFU, SHFL, LDG) |")
    print("|---|---|---:|---:|---|")
    for config in configs:
        report = compile_report(*config)
        flags = ", ".join(f"{k}" if v else f"!{k}" for k, v in report["flags"].items())
        body = "; ".join(f"{sum(ops.values())} ({ops['MUFU']}, {ops['SHFL']}, {ops['LDG']})"
                         for _, _, ops in report["loops"]) or "none"  # fmt: skip
        print(f"| {report['kernel']} | {flags} | {report['registers']} | {report['instructions']} | {body} |")


if __name__ == "__main__":
    main()
