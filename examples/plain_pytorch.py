"""DiLoCoX from a plain PyTorch loop, with a model of your own (a byte-level MLP here).

dilocox server --port 50051 --run-id own-loop --min-clusters 2 --insecure &
python examples/plain_pytorch.py --site 0 & python examples/plain_pytorch.py --site 1
"""

import argparse
import importlib.resources

import torch
import torch.nn.functional as F
from torch import nn

from dilocox import DiLoCoX, InnerConfig, RunConfig

CONTEXT = 16


class ByteMLP(nn.Module):  # your model: any nn.Module
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.mix = nn.Sequential(nn.Linear(width * CONTEXT, 4 * width), nn.GELU(), nn.Linear(4 * width, 256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, CONTEXT) bytes → logits of the next byte
        return self.mix(self.embed(x).flatten(1))


parser = argparse.ArgumentParser()
parser.add_argument("--servers", default="127.0.0.1:50051")
parser.add_argument("--site", type=int, default=0)
parser.add_argument("--sites", type=int, default=2)
parser.add_argument("--rounds", type=int, default=5)
args = parser.parse_args()

text = importlib.resources.files("dilocox.common").joinpath("data/tinyshakespeare.txt").read_bytes()
data = torch.tensor(list(text), dtype=torch.long)
held_out, data = data[: len(data) // 10], data.chunk(args.sites)[args.site]  # each site trains on its own part
generator = torch.Generator().manual_seed(args.site)


def batch(tokens: torch.Tensor, n: int = 32, g: torch.Generator = generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(tokens) - CONTEXT - 1, (n,), generator=g)
    windows = torch.stack([tokens[s : s + CONTEXT + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, -1]


x_eval, y_eval = batch(held_out, 256, torch.Generator().manual_seed(0))
model = ByteMLP()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
config = RunConfig(run_id="own-loop", rounds=args.rounds, inner=InnerConfig(steps=20))
evaluate = torch.no_grad()(lambda: F.cross_entropy(model(x_eval), y_eval).item())
with DiLoCoX(
    model, servers=args.servers, config=config, cluster=f"site-{args.site}", num_clusters=args.sites, evaluate=evaluate
) as dx:
    while not dx.done:
        x, y = batch(data)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if r := dx.step(tokens=x.numel(), loss=loss.detach()):  # the round's report, at its last step
            print(f"site {args.site} round {r.round}: train loss {r.train_loss:.3f}, eval loss {r.eval_loss:.3f}")
print(f"site {args.site} done: eval loss {dx.final_eval_loss:.3f} on the run's final model")
