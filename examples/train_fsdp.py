"""Train a model sharded with FSDP2 under one SlackSwap plan on every rank.

    torchrun --nproc-per-node 2 examples/train_fsdp.py            # CPU, gloo
    torchrun --nproc-per-node 8 examples/train_fsdp.py --ddp      # DDP instead of FSDP2

On GPUs the same command uses NCCL and each rank's own device. Rank 0 profiles the
unsharded model and plans; every rank receives that plan and checks it against its own
model and batch. ``--budget`` is the activation budget as a fraction of the no-limit
peak, or bytes (``12GiB``).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import slackswap
from slackswap.models import build_model
from slackswap.profiling.step import transformer_blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-xl-tiny")
    parser.add_argument("--budget", default="0.5")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ddp", action="store_true", help="DistributedDataParallel")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    model, batch = build_model(args.model, fake=False, dtype="bf16" if cuda else "fp32",
                               device=device)  # your model and batch; same seed per rank
    # --8<-- [start:core]
    if args.ddp:
        net = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        modules = dict(model.named_modules())
        for path in transformer_blocks(model):  # shard each block, then the rest
            fully_shard(modules[path])
        net = fully_shard(model)
    plan = slackswap.plan(net, batch, budget=args.budget, group=dist.group.WORLD)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    for step in range(args.steps):
        with slackswap.apply(net, plan) as runtime:
            loss = net(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            stats = runtime.stats
            print(f"step {step}: loss {loss.item():.4f}, offloaded "
                  f"{stats.offloaded_bytes / 2**20:.1f} MiB, recomputed "
                  f"{stats.recomputed_ops} ops")
    # --8<-- [end:core]
    del net, model, optimizer  # before the group goes (docs/training/distributed.md)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
