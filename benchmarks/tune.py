"""What the launch-tuning scripts (``scan_tune.py``, ``ssd_tune.py``, ``conv_tune.py``, ``decode_tune.py``) share:
their one option, ``--smoke`` (tiny sizes on CPU under Triton's interpreter, the CI check that they keep working),
and the device it selects."""

from __future__ import annotations

import argparse
import os

import torch


def tuning_device(description: str) -> tuple[bool, torch.device]:
    """Parse ``--smoke`` and return ``(smoke, device)``: the CPU under ``TRITON_INTERPRET=1`` for a smoke run,
    else the CUDA device; exits with a usage error when that is not available."""
    options, device = tuning_options(argparse.ArgumentParser(description=description))
    return options.smoke, device


def tuning_options(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, torch.device]:
    """Add ``--smoke`` to ``parser``, parse the command line and return the options with the device they select
    (as :func:`tuning_device`), for a script with options of its own."""
    parser.add_argument("--smoke", action="store_true", help="two choices, tiny sizes, CPU interpreter")
    options = parser.parse_args()
    if options.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        return options, torch.device("cpu")
    if not torch.cuda.is_available():
        parser.error("no CUDA device (use --smoke for the CPU check)")
    return options, torch.device("cuda")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
