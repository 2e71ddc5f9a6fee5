"""Mamba-1's mixer keeps fp32 copies of A, D, dt's bias and the conv weights for its kernels: they are reused
while the weights stay as they are and follow every way the weights can change."""

from __future__ import annotations

import torch
from torch import nn

from rnnserve.engine.models.mamba import MambaConfig, MambaMixer

CONFIG = MambaConfig(vocab_size=16, d_model=8, n_layers=1, d_inner=16, d_state=4, d_conv=4, dt_rank=2)


def _mixer() -> MambaMixer:
    mixer = MambaMixer(CONFIG).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in mixer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return mixer


def _a_and_d(mixer: MambaMixer) -> tuple[torch.Tensor, torch.Tensor]:
    weights = mixer.fused_decode_weights()
    a, d = weights[7], weights[8]
    assert a is not None and d is not None
    return a, d


def _assert_current(mixer: MambaMixer) -> None:
    a, d = _a_and_d(mixer)
    assert a.dtype == d.dtype == torch.float32
    torch.testing.assert_close(a, -torch.exp(mixer.A_log.detach().float()), atol=0, rtol=0)
    torch.testing.assert_close(d, mixer.D.detach().float(), atol=0, rtol=0)


def test_unchanged_weights_reuse_the_fp32_copies() -> None:
    mixer = _mixer()
    assert _a_and_d(mixer)[0] is _a_and_d(mixer)[0]


def test_the_fp32_copies_follow_in_place_updates_new_tensors_and_loads() -> None:
    mixer = _mixer()
    _assert_current(mixer)
    with torch.no_grad():
        mixer.A_log.add_(0.5)
    _assert_current(mixer)
    mixer.D = nn.Parameter(mixer.D.detach() * 2)
    _assert_current(mixer)
    state = {name: tensor + 1 for name, tensor in mixer.state_dict().items()}
    mixer.load_state_dict(state)
    _assert_current(mixer)


def test_inference_tensors_follow_a_load() -> None:
    """Inference tensors carry no version counter: a load_state_dict into them drops the copies all the same."""
    with torch.inference_mode():
        mixer = _mixer()
        _assert_current(mixer)
        mixer.load_state_dict({name: tensor - 1 for name, tensor in mixer.state_dict().items()})
        _assert_current(mixer)
