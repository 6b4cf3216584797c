"""A tiny transformer language model on generated sequences (no downloads, torch only).

    flodl run --local --ranks 3 -- python -m flodl_worker.examples.tinylm [--samples 2048]
        [--seq-len 32] [--vocab 16] [--d-model 32] [--layers 2] [--heads 2] [--lr 0.01]
        [--lr-scale auto|none|sqrt|linear]

The text is drawn from a fixed random *source*: an order-2 Markov chain over ``--vocab``
tokens (the next token depends on the two before it, so a model must look past the last
token), its transition table drawn from ``--data-seed`` and sharpened so it is learnable.
Every rank generates the same sequences; the held-out ones are drawn separately from the
same source. The model is a decoder-only transformer: token + learned position
embeddings, ``--layers`` pre-norm blocks of causal self-attention and an MLP, a final
LayerNorm, a linear head. Each step is next-token cross-entropy.

The optimizer is Adam at ``--lr`` times sqrt(world size) (``--lr-scale auto``): each
rank's Adam step is normalised by its own batch's gradient noise, so the average of K
ranks' steps goes about 1/sqrt(K) as far as DDP's one step at ``--lr``
(``flodl_worker.run_world``); ``--lr-scale none`` keeps ``--lr`` as given.

``eval_fn`` is the held-out next-token accuracy (the summary's ``accuracy``); it also
prints the held-out loss and perplexity, with the source's own entropy (the best loss any
model can reach) beside them. Trains in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from flodl_worker.rank import run_rank

from ._common import add_optim_args, make_optimizer, positive_int

SHARPNESS = 3.0  # logits of the source's transition table are N(0, 1) * this: a few likely next tokens


def source(vocab: int, seed: int) -> torch.Tensor:
    """The order-2 transition table: probs[a, b, :] = P(next | the two before are a, b)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, vocab, vocab, generator=g) * SHARPNESS, dim=-1)


def generate(probs: torch.Tensor, count: int, length: int, seed: int) -> torch.Tensor:
    """``count`` sequences of ``length`` tokens drawn from the source, a pure function of the arguments."""
    g = torch.Generator().manual_seed(seed)
    vocab = probs.shape[0]
    seq = torch.empty(count, length, dtype=torch.long)
    seq[:, :2] = torch.randint(vocab, (count, 2), generator=g)
    for t in range(2, length):
        seq[:, t] = torch.multinomial(probs[seq[:, t - 2], seq[:, t - 1]], 1, generator=g).squeeze(1)
    return seq


class Block(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + mlp(ln(x)); causal self-attention."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        drop = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop)
        x = x + self.proj(a.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, length: int, d: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"--d-model {d} must be a multiple of --heads {heads}")
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.Sequential(*[Block(d, heads, dropout) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.head(self.ln(self.blocks(h)))


def lm_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> torch.Tensor:
    x, y = batch
    optimizer.zero_grad(set_to_none=True)
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.detach()


def heldout_metrics(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Held-out next-token loss (nats), perplexity and accuracy (call under no_grad, eval())."""
    dev = next(model.parameters()).device  # the rank's device (run_rank(device=...))
    x, y = x.to(dev), y.to(dev)
    logits = model(x)
    loss = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
    acc = float((logits.argmax(dim=-1) == y).float().mean())
    return {"loss": loss, "perplexity": math.exp(loss), "accuracy": acc}


def source_entropy(probs: torch.Tensor, seq: torch.Tensor) -> float:
    """The source's mean cross-entropy on ``seq`` past the first two tokens: the best loss reachable there."""
    p = probs[seq[:, :-2], seq[:, 1:-1], seq[:, 2:]]
    return float(-p.log().mean())


def eval_fn(x: torch.Tensor, y: torch.Tensor, floor: float):
    def evaluate(model: nn.Module) -> float:
        m = heldout_metrics(model, x, y)
        print(f"held-out: loss {m['loss']:.4f} (source entropy {floor:.4f}), perplexity {m['perplexity']:.3f}, "
              f"next-token accuracy {m['accuracy']:.4f}", file=sys.stderr, flush=True)  # fmt: skip
        return m["accuracy"]

    return evaluate


def epoch_report(x: torch.Tensor, y: torch.Tensor):
    def report(model: nn.Module, epoch: int, metrics: dict) -> None:
        model.eval()
        with torch.no_grad():
            m = heldout_metrics(model, x, y)
        print(f"epoch {epoch + 1}: avg loss {metrics['avg_loss']:.4f}, held-out loss {m['loss']:.4f}, "
              f"perplexity {m['perplexity']:.3f}", file=sys.stderr)  # fmt: skip

    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m flodl_worker.examples.tinylm", description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=positive_int, default=2048, help="training sequences (default 2048)")
    p.add_argument("--test-samples", type=positive_int, default=512, help="held-out sequences (default 512)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens a sequence is predicted over (default 32)")
    p.add_argument("--vocab", type=positive_int, default=16, help="vocabulary size (default 16)")
    p.add_argument("--data-seed", type=int, default=0, help="seed of the source and the sequences (default 0)")
    p.add_argument("--d-model", type=positive_int, default=32, help="model width (default 32)")
    p.add_argument("--layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--heads", type=positive_int, default=2, help="attention heads (default 2)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout in attention and MLP (default 0.1)")
    add_optim_args(p, lr=1e-2, hidden=None, optimizer="adam")
    args = p.parse_args(argv)
    if args.seq_len < 3:
        p.error("--seq-len must be >= 3 (the source looks two tokens back)")
    if args.d_model % args.heads:
        p.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    probs = source(args.vocab, args.data_seed)
    train_seq = generate(probs, args.samples, args.seq_len + 1, args.data_seed + 1)
    test_seq = generate(probs, args.test_samples, args.seq_len + 1, args.data_seed + 2)
    x_te, y_te = test_seq[:, :-1], test_seq[:, 1:]
    run_rank(
        lambda: TinyLM(args.vocab, args.seq_len, args.d_model, args.layers, args.heads, args.dropout),
        make_optimizer(args),
        lm_step,
        TensorDataset(train_seq[:, :-1], train_seq[:, 1:]),
        eval_fn=eval_fn(x_te, y_te, source_entropy(probs, test_seq)),
        epoch_fn=epoch_report(x_te, y_te) if args.epoch_report else None,
        task="tinylm",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
