"""The peer we compare with: torch DistributedDataParallel (gloo) on the same emulation.

Each of N processes trains the same MLP with the same batch size and step function as
flodl's examples, on an equal shard of a per-epoch shuffle, and sleeps
``base_ms × slowdown[rank]`` after every batch, exactly as a flodl rank does
(``FLODL_SLOWDOWN``). DDP all-reduces gradients every step, so every step waits for the
slowest rank. Prints one JSON line: samples/s over the timed epochs and the final
held-out accuracy (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from flodl_worker.examples._common import classification_step, mlp


def load_task(task: str):
    if task == "digits":
        from flodl_worker.examples.digits import load

        train, x_te, y_te = load()
        return train, x_te, y_te, (64, 64, 10), 0.05
    from flodl_worker.examples.synthetic import generate

    train, x_te, y_te = generate(4096, 1024, 32, 4, 0)
    return train, x_te, y_te, (32, 64, 4), 0.05


def worker(rank: int, args, port: int, out_q) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    train, x_te, y_te, dims, lr = load_task(args.task)
    torch.manual_seed(args.seed)
    model = DDP(mlp(*dims))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    slow = [float(s) for s in args.slowdown.split(",")][rank]
    x_all, y_all = train.tensors
    n = len(train)
    dist.barrier()
    t0 = time.perf_counter()
    samples = 0
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(n, generator=g)
        shard = perm[rank :: args.ranks]
        for i in range(0, len(shard), args.batch_size):
            idx = shard[i : i + args.batch_size]
            classification_step(model, opt, (x_all[idx], y_all[idx]))
            time.sleep(args.base_ms * slow / 1000.0)
            samples += len(idx)
    dist.barrier()
    wall = time.perf_counter() - t0
    total = torch.tensor([samples], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        with torch.no_grad():
            acc = float((model.module(x_te).argmax(1) == y_te).float().mean())
        out_q.put({"samples": int(total.item()), "wall_s": wall, "samples_per_s": total.item() / wall, "accuracy": acc})
    dist.destroy_process_group()


def run(args) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    res = q.get(timeout=args.timeout)
    for p in procs:
        p.join(timeout=60)
    return res


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="synthetic", choices=("synthetic", "digits"))
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--slowdown", default="1,2,4")
    p.add_argument("--base-ms", type=float, default=10.0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--timeout", type=float, default=900)
    return p


if __name__ == "__main__":
    print(json.dumps(run(parser().parse_args(sys.argv[1:]))))
