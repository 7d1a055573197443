"""One DiLoCoX site of several ranks under torchrun, its model sharded by torch's FSDP2 (NCCL on GPUs,
gloo on CPU). Each rank exchanges the parameters it owns; the shards see one site.

    dilocox server --port 50051 --run-id fsdp2 --insecure &
    torchrun --nproc-per-node 2 examples/torchrun_fsdp2.py
"""

import argparse
import importlib.resources
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import dilocox
from dilocox import DiLoCoX, InnerConfig, ParallelConfig, RunConfig, SiteMesh

parser = argparse.ArgumentParser()
parser.add_argument("--servers", default="127.0.0.1:50051")
parser.add_argument("--rounds", type=int, default=4)
args = parser.parse_args()
world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])

config = RunConfig(run_id="fsdp2", rounds=args.rounds, inner=InnerConfig(steps=10), parallel=ParallelConfig(dp=world))
mesh = SiteMesh(config.parallel)  # the process group and the site's meshes, from torchrun's environment


class ByteNet(nn.Module):  # your model: next byte from each byte, through residual MLP blocks
    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(256, width), nn.Linear(width, 256)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the loss of predicting x[:, 1:]
        h = self.embed(x[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), x[:, 1:].flatten())


with dilocox.parameters_on_meta():  # built sharded: no rank ever holds the whole model
    model = ByteNet()
for block in model.blocks:  # FSDP2 as torchtitan applies it: each block a unit, then the root
    fully_shard(block, mesh=mesh.fsdp_mesh)
fully_shard(model, mesh=mesh.fsdp_mesh)
dilocox.materialize(model, mesh.device, seed=0)  # this rank's rows, the same bits in any layout
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
text = importlib.resources.files("dilocox.common").joinpath("data/tinyshakespeare.txt").read_bytes()
data = torch.tensor(list(text), dtype=torch.long)[: len(text) // 33 * 33].view(-1, 33)
generator = torch.Generator().manual_seed(rank)  # each rank its own batches
evaluate = torch.no_grad()(lambda: model(data[:64].to(mesh.device)).item())
with DiLoCoX(model, servers=args.servers, config=config, cluster="fsdp2-site", mesh=mesh, evaluate=evaluate) as dx:
    while not dx.done:
        x = data[torch.randint(0, len(data), (16,), generator=generator)].to(mesh.device)
        loss = model(x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (report := dx.step(tokens=x.numel() * world, loss=loss.detach())) and rank == 0:
            print(f"round {report.round}: train loss {report.train_loss:.3f}, eval loss {report.eval_loss:.3f}")
if rank == 0:
    print(f"fsdp2 site done: eval loss {dx.final_eval_loss:.3f}")
mesh.close()
