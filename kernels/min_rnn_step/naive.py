"""PyTorch reference for the minGRU / minLSTM gates and their one-step recurrence.

``proj`` is the cell's input projection ``[..., P * D]``: ``(k, h~)`` for minGRU (P = 2), ``(f, i, h~)``
for minLSTM (P = 3). Both cells reduce to ``h_t = a_t * h_{t-1} + b_t`` with positive ``b`` (candidate
``g(h~) > 0``); the ``log_*`` forms feed the log-space prefill scan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def g(x: torch.Tensor) -> torch.Tensor:
    """The paper's positive candidate activation: ``x + 0.5`` for ``x >= 0`` else ``sigmoid(x)``."""
    return torch.where(x >= 0, x + 0.5, torch.sigmoid(x))


def log_g(x: torch.Tensor) -> torch.Tensor:
    """``log(g(x))`` computed stably."""
    return torch.where(x >= 0, torch.log(F.relu(x) + 0.5), -F.softplus(-x))


def mingru_coefficients(proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``z = sigmoid(k)``: ``a = 1 - z``, ``b = z * g(h~)`` in fp32."""
    k, candidate = proj.float().chunk(2, dim=-1)
    z = torch.sigmoid(k)
    return 1.0 - z, z * g(candidate)


def mingru_log_coefficients(proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """minGRU's step coefficients in log space, ``(log a, log b)`` in fp32, for the log-space scan."""
    k, candidate = proj.float().chunk(2, dim=-1)
    return -F.softplus(k), -F.softplus(-k) + log_g(candidate)


def _gate_diff(f: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``log f' - log i'`` up to sign: ``f' = sigmoid(-diff)``, ``i' = sigmoid(diff)`` (no 0/0)."""
    return F.softplus(-f) - F.softplus(-i)


def minlstm_coefficients(proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised gates ``f' = f / (f + i)``, ``i' = i / (f + i)``: ``a = f'``, ``b = i' * g(h~)`` in fp32."""
    f, i, candidate = proj.float().chunk(3, dim=-1)
    diff = _gate_diff(f, i)
    return torch.sigmoid(-diff), torch.sigmoid(diff) * g(candidate)


def minlstm_log_coefficients(proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """minLSTM's normalised gates in log space, ``(log f', log(i' * g(h~)))`` in fp32, for the
    log-space scan."""
    f, i, candidate = proj.float().chunk(3, dim=-1)
    diff = _gate_diff(f, i)
    return -F.softplus(diff), -F.softplus(-diff) + log_g(candidate)


COEFFICIENTS = {"mingru": mingru_coefficients, "minlstm": minlstm_coefficients}
LOG_COEFFICIENTS = {"mingru": mingru_log_coefficients, "minlstm": minlstm_log_coefficients}


def min_rnn_step_ref(proj: torch.Tensor, h: torch.Tensor, cell: str) -> torch.Tensor:
    """One step ``h_new = a * h + b`` of ``cell`` (``"mingru"`` or ``"minlstm"``) in fp32."""
    a, b = COEFFICIENTS[cell](proj)
    return a * h.float() + b
