"""Train the embedded default model: a small byte-level minGRU on Debian's ``fortunes`` cookie files.

One command reproduces ``engine/default_model/`` on a fresh machine (Debian or Ubuntu; as root the script
refreshes the apt package lists itself when ``apt-get download`` finds nothing)::

    make default-model            # = .venv/bin/python scripts/train_default_model.py

The corpus is fetched with ``apt-get download fortunes`` and unpacked with ``dpkg-deb -x`` into
``data/fortunes/`` (git-ignored). Fortunes are split on their ``%`` separator lines, shuffled with a
fixed seed, 5% held out for validation, and joined with ``<|endoftext|>`` (id 256) between them.
Training runs AdamW on random windows with a full-sequence forward written here from the model's own
modules (causal depthwise conv + log-space minGRU scan, the same math as ``MinRNNBlock.prefill``). The
learning-rate schedule follows ``max(step / steps, elapsed / time budget)`` so the run always anneals and
ends within ``--minutes``, and is step-for-step deterministic whenever the machine is fast enough.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rnnserve.engine.loader import DEFAULT_MODEL_DIR, load_model, save_checkpoint  # noqa: E402
from rnnserve.engine.models.base import DecodeBatch, PrefillBatch  # noqa: E402
from rnnserve.engine.models.minrnn import MinGRULM, MinRNNBlock, MinRNNConfig  # noqa: E402

PACKAGE = "fortunes"
EXCLUDED_FILES = {"ascii-art"}  # pictures, not prose
EOS = 256
LayerState = tuple[torch.Tensor, torch.Tensor]


def fetch_corpus(data_dir: Path) -> Path:
    """Download and unpack Debian's ``fortunes`` package into ``data_dir`` once; return the cookie folder."""
    cookies = data_dir / "usr" / "share" / "games" / "fortunes"
    if cookies.is_dir():
        return cookies
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, capture_output=True, text=True)
        if result.returncode != 0 and os.geteuid() == 0:
            # A fresh machine has no package lists yet: fetch them once and retry.
            subprocess.run(["apt-get", "update", "-qq"], check=False)
            result = subprocess.run(["apt-get", "download", PACKAGE], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob(f"{PACKAGE}_*.deb"))
        if result.returncode != 0 or not debs:
            raise SystemExit(
                f"apt-get download {PACKAGE} failed ({result.stderr.strip()}); run `apt-get update` once and retry"
            )
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(data_dir)], check=True)
        shutil.copy(debs[0], data_dir / debs[0].name)
    return cookies


def package_version(data_dir: Path) -> str:
    """The version of the downloaded ``fortunes`` .deb (from its file name)."""
    debs = sorted(data_dir.glob(f"{PACKAGE}_*.deb"))
    return debs[0].name.split("_")[1].replace("%3a", ":") if debs else "unknown"


def load_fortunes(cookies: Path) -> list[bytes]:
    """Every fortune of every cookie file (sorted by name), stripped, as UTF-8 bytes."""
    fortunes: list[bytes] = []
    for file in sorted(cookies.iterdir()):
        if file.is_symlink() or file.suffix == ".dat" or file.name in EXCLUDED_FILES:
            continue
        text = file.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n")
        chunks = text.split("\n%\n")
        fortunes.extend(c.strip("\n%").encode("utf-8") for c in chunks if c.strip("\n%").strip())
    return fortunes


def to_stream(fortunes: list[bytes]) -> torch.Tensor:
    """Fortunes joined with EOS (and one EOS before the first) as a long tensor of token ids."""
    ids: list[int] = [EOS]
    for fortune in fortunes:
        ids.extend(fortune)
        ids.append(EOS)
    return torch.tensor(ids, dtype=torch.long)


def log_scan(log_a: torch.Tensor, log_b: torch.Tensor, h: torch.Tensor | None, chunk: int) -> torch.Tensor:
    """Differentiable ``h_t = exp(log_a_t) h_{t-1} + exp(log_b_t)`` over ``[B, T, D]``; returns log h.

    Heinsen scan within chunks of ``chunk`` steps, the log-state carried between chunks (as in
    ``diag_log_scan_ref``); ``h`` is the linear-space initial state or ``None`` for zeros.
    """
    log_h = None if h is None else torch.log(h)
    outs = []
    for start in range(0, log_a.shape[1], chunk):
        a_star = torch.cumsum(log_a[:, start : start + chunk], dim=1)
        out = a_star + torch.logcumsumexp(log_b[:, start : start + chunk] - a_star, dim=1)
        if log_h is not None:
            out = torch.logaddexp(out, a_star + log_h[:, None])
        outs.append(out)
        log_h = out[:, -1]
    return torch.cat(outs, dim=1)


def block_forward(
    block: MinRNNBlock, x: torch.Tensor, state: LayerState | None
) -> tuple[torch.Tensor, LayerState]:
    """``MinRNNBlock.prefill`` on a dense ``[B, T, d]`` batch; ``state`` = (conv tail [B, K-1, d], h [B, dh])."""
    batch, _, d = x.shape
    width = block.conv_weight.shape[1]
    u = block.norm1(x)
    tail = u.new_zeros(batch, width - 1, d) if state is None else state[0]
    padded = torch.cat([tail, u], dim=1)
    conv = F.conv1d(padded.transpose(1, 2), block.conv_weight[:, None, :], block.conv_bias, groups=d)
    log_a, log_b = block.cell.log_coefficients(block.in_proj(conv.transpose(1, 2)))
    log_h = log_scan(log_a, log_b, None if state is None else state[1], block.scan_chunk_size)
    x = x + block.out_proj(torch.exp(log_h).to(x.dtype))
    new_state = (padded[:, -(width - 1) :].detach(), torch.exp(log_h[:, -1]).detach())
    return block._mlp(x), new_state


def lm_forward(
    model: MinGRULM, ids: torch.Tensor, states: list[LayerState] | None = None
) -> tuple[torch.Tensor, list[LayerState]]:
    """Training forward: ``ids [B, T]`` -> ``(logits [B, T, V], per-layer states)``."""
    x = model.embed(ids)
    new_states = []
    for i, layer in enumerate(model.layers):
        x, layer_state = block_forward(layer, x, None if states is None else states[i])
        new_states.append(layer_state)
    return model.lm_head(model.norm_f(x)), new_states


@torch.no_grad()
def bits_per_byte(model: MinGRULM, stream: torch.Tensor, shards: int = 16, seq_len: int = 256) -> float:
    """Mean next-token loss in bits over ``stream``, read as ``shards`` contiguous pieces with state carried."""
    model.eval()
    length = (stream.numel() - 1) // shards
    inputs = stream[: shards * length].view(shards, length)
    targets = stream[1 : shards * length + 1].view(shards, length)
    states = None
    total = 0.0
    for start in range(0, length, seq_len):
        logits, states = lm_forward(model, inputs[:, start : start + seq_len], states)
        window = targets[:, start : start + seq_len].flatten()
        total += F.cross_entropy(logits.flatten(0, 1), window, reduction="sum").item()
    model.train()
    return total / (shards * length) / math.log(2)


def build_model(args: argparse.Namespace) -> MinGRULM:
    config = MinRNNConfig(
        vocab_size=320, d_model=args.d_model, n_layers=args.n_layers, expansion=2, mlp_ratio=args.mlp_ratio
    )
    model = MinGRULM(config)
    generator = torch.Generator().manual_seed(args.seed)
    model.init_weights(generator)
    for layer in model.layers:  # residual branches start small so the stack begins near the identity
        for proj in (layer.out_proj, layer.mlp_out):
            proj.weight.data.mul_((2 * config.n_layers) ** -0.5)
    return model


def make_optimizer(model: MinGRULM, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "conv" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "conv" not in n)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def learning_rate(progress: float, step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% of ``--lr`` as ``progress`` goes 0 -> 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def check_serving_path(model: MinGRULM, sample: torch.Tensor) -> float:
    """Max |logit difference| between the training forward and the model's prefill + decode path."""
    model.eval()
    config = model.config
    ref, _ = lm_forward(model, sample[None])
    state = {
        "conv": torch.zeros(1, config.n_layers, config.d_model, config.conv_kernel - 1),
        "h": torch.zeros(1, config.n_layers, config.d_hidden),
    }
    tokens = sample.tolist()
    split = len(tokens) // 2
    served = [model.prefill(PrefillBatch.build([tokens[:split]], [0]), state)]
    served += [model.decode(DecodeBatch.build([tokens[t]], [0], [t]), state) for t in range(split, len(tokens) - 1)]
    served_logits = torch.cat(served)
    return (served_logits - ref[0, split - 1 : -1]).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--data-dir", type=Path, default=ROOT / "data" / "fortunes")
    parser.add_argument("--minutes", type=float, default=25.0, help="wall-clock budget for the training loop")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=3)
    parser.add_argument("--mlp-ratio", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    started = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cookies = fetch_corpus(args.data_dir)
    fortunes = load_fortunes(cookies)
    random.Random(args.seed).shuffle(fortunes)
    n_val = len(fortunes) // 20
    train, val = to_stream(fortunes[n_val:]), to_stream(fortunes[:n_val])
    print(f"corpus: Debian package {PACKAGE} {package_version(args.data_dir)}, {len(fortunes)} fortunes, "
          f"train {train.numel():,} tokens, validation {val.numel():,} tokens", flush=True)

    model = build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {model.config}, {n_params:,} parameters ({4 * n_params / 1e6:.2f} MB fp32)", flush=True)
    optimizer = make_optimizer(model, args.lr, args.weight_decay)
    generator = torch.Generator().manual_seed(args.seed)
    val_probe = val[: 16 * 4096 + 1]
    offsets = torch.arange(args.seq_len + 1)
    budget = args.minutes * 60.0
    train_start = time.monotonic()
    model.train()
    step = 0
    while step < args.steps:
        elapsed = time.monotonic() - train_start
        if elapsed >= budget:
            print(f"time budget reached at step {step}", flush=True)
            break
        lr = learning_rate(max(step / args.steps, elapsed / budget), step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, train.numel() - args.seq_len - 1, (args.batch_size,), generator=generator)
        window = train[starts[:, None] + offsets]
        logits, _ = lm_forward(model, window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 25 == 0:
            print(f"step {step} loss {loss.item() / math.log(2):.3f} bits lr {lr:.2e} "
                  f"elapsed {time.monotonic() - train_start:.0f}s", flush=True)
        if step % args.eval_every == 0:
            print(f"step {step} probe validation bpb {bits_per_byte(model, val_probe):.4f}", flush=True)
    train_seconds = time.monotonic() - train_start

    val_bpb = bits_per_byte(model, val)
    drift = check_serving_path(model, val[:300])
    print(f"trained {step} steps ({step * args.batch_size * args.seq_len:,} tokens) in {train_seconds / 60:.1f} min; "
          f"validation bits per byte {val_bpb:.4f}; prefill/decode vs training forward max |dlogit| {drift:.2e}",
          flush=True)
    if drift > 1e-3:
        raise SystemExit("the serving path disagrees with the training forward")

    save_checkpoint(model.eval(), args.out)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"saved {args.out} ({size / 1e6:.2f} MB)", flush=True)

    from rnnserve.engine import LLM, SamplingParams

    loaded, _ = load_model(str(args.out), device="cpu")
    assert bits_per_byte(loaded, val[: 16 * 1024 + 1]) == bits_per_byte(model, val[: 16 * 1024 + 1])
    llm = LLM(str(args.out), device="cpu")
    for prompt in ("The ", "A man "):
        params = SamplingParams(temperature=0.7, max_tokens=200, seed=0)
        text = llm.generate([prompt], params)[0].outputs[0].text
        print(f"sample (temperature 0.7, seed 0) {prompt!r} -> {text!r}", flush=True)
    print(f"total time {(time.monotonic() - started) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
