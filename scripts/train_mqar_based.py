"""Train a small Based model on MQAR for a few minutes on CPU, save it as a native checkpoint and measure its
recall when served by rnnserve (prefill + recurrent state, token by token as a server runs it).

    python scripts/train_mqar_based.py [--minutes 31] [--out /tmp/based-mqar]   # served recall 0.999 (docs/models.md)

Training (AdamW at a constant learning rate) runs a dense full-sequence forward written here from the model's own
modules (BaseConv as a padded ``conv1d``, Taylor linear attention as its causal quadratic form, sliding-window
attention as masked softmax);
before serving, the script checks that this forward and rnnserve's prefill give the same logits. The sliding
window is kept short (a query sees 5 keys) so the recall has to come from the linear-attention state.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import argparse  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rnnserve.engine.models.based import BasedConfig, BasedLM  # noqa: E402
from rnnserve.engine.models.layers import RMSNorm, apply_rope, rope_cos_sin  # noqa: E402
from scripts.mqar import train_and_serve  # noqa: E402

VOCAB = 64
NUM_PAIRS = 8


def mqar_config(width: int = 64) -> BasedConfig:
    """4 layers: BaseConv, linear attention, sliding window (5 keys), linear attention; heads of 16 channels."""
    return BasedConfig(
        vocab_size=VOCAB, d_model=width, n_layers=4, mlp_hidden=2 * width, linear_attention_layers=[1, 3],
        sliding_window_layers=[2], la_heads=width // 16, la_feature_dim=16, la_head_dim=16, taylor_input_dim=16,
        sw_heads=width // 16, window_size=8, rotary_dim=16,
    )


def _rms(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _mixer(block: torch.nn.Module, h: torch.Tensor, config: BasedConfig) -> torch.Tensor:
    """One mixer over whole sequences ``h [N, T, d]`` from position 0 (differentiable)."""
    mixer, (n, length, _) = block.mixer, h.shape
    if block.kind == "conv":
        u1, u2 = mixer.in_proj(h).split(mixer.d_inner, dim=-1)
        weight = mixer.conv.conv.weight
        conv = F.conv1d(u1.transpose(1, 2), weight, padding=weight.shape[-1] - 1, groups=mixer.d_inner)
        return mixer.out_proj(F.silu(conv[..., :length].transpose(1, 2)) * u2)
    if block.kind == "linear_attention":
        q = mixer.proj_q(h).view(n, length, mixer.heads, mixer.feature_dim)
        k = mixer.proj_k(h).view(n, length, mixer.heads, mixer.feature_dim)
        v = mixer.proj_v(h).view(n, length, mixer.heads, mixer.head_dim)
        s = torch.einsum("nihf,njhf->nhij", q, k) * mixer.scale
        a = torch.tril(1 + s + 0.5 * s * s)
        y = torch.einsum("nhij,njhd->nihd", a, v) / (a.sum(-1).transpose(1, 2)[..., None] + mixer.eps)
        return mixer.out_proj(y.reshape(n, length, -1))
    heads, head_dim = mixer.attention.n_heads, mixer.attention.head_dim
    qkv = mixer.Wqkv(h).view(n * length, 3, heads, head_dim)
    cos, sin = rope_cos_sin(torch.arange(length).repeat(n), config.rotary_dim, config.rope_theta, h.dtype)
    q, k = (apply_rope(t, cos, sin).view(n, length, heads, -1) for t in (qkv[:, 0], qkv[:, 1]))
    v = qkv[:, 2].view(n, length, heads, -1)
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    visible = (j <= i) & (j >= i - config.ring_size)
    scores = torch.einsum("nihd,njhd->nhij", q, k) * head_dim**-0.5
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return mixer.out_proj(torch.einsum("nhij,njhd->nihd", weights, v).reshape(n, length, -1))


def dense_logits(model: BasedLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[N, T, V]`` of whole sequences ``ids [N, T]``."""
    x = model.transformer.embeddings.word_embeddings(ids)
    for block in model.transformer.layers:
        x = x + _mixer(block, _rms(x, block.norm1), model.config)
        y, gate = block.mlp.fc1(_rms(x, block.norm2)).chunk(2, dim=-1)
        x = x + block.mlp.fc2(y * F.silu(gate))
    return model.lm_head(_rms(x, model.transformer.ln_f))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=31.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/based-mqar"))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--width", type=int, default=64, help="model width, a multiple of 16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    model = BasedLM(mqar_config(args.width))
    model.init_weights(torch.Generator().manual_seed(args.seed))
    train_and_serve(model, dense_logits, pairs=NUM_PAIRS, vocab_size=VOCAB, batch=args.batch, lr=args.lr,
                    minutes=args.minutes, seed=args.seed, out=args.out)

if __name__ == "__main__":
    main()
