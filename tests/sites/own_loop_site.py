"""A site driven by a user-written loop over `dilocox.DiLoCoX` (tests/test_api.py runs it as a process).

It trains the built-in GPT with the same arithmetic as the CLI's trainer — same model from the seed, AdamW,
schedule, batches and clipping — written out as a user would, one `dx.step` per optimizer step, so that
a run of it and a run of `dilocox worker` can be compared bit for bit.
"""

from __future__ import annotations

import argparse

import torch

from dilocox import DiLoCoX, load_run_config
from dilocox.worker.data.corpus import BatchSampler, data_part, evaluate_run
from dilocox.worker.data.token_data import load_run_data
from dilocox.worker.models.build import build_model
from dilocox.worker.models.contract import lm_loss
from dilocox.worker.train.inner_trainer import inner_lr, make_inner_optimizer

parser = argparse.ArgumentParser()
parser.add_argument("--servers", required=True)
parser.add_argument("--config", required=True)
parser.add_argument("--cluster", default="own-loop")
parser.add_argument("--cluster-index", type=int, default=0)
parser.add_argument("--num-clusters", type=int, default=1)
parser.add_argument("--out", required=True, help="where the final weights are saved (torch.save)")
parser.add_argument(
    "--stop-after-round", type=int, default=0, help="save state_dict() after this round and stop (exit 0)"
)
parser.add_argument("--resume", help="a state saved by --stop-after-round")
args = parser.parse_args()
torch.set_num_threads(1)

config = load_run_config(args.config)
data = load_run_data(config.tokenizer, None)
model = build_model(config.model, data.vocab_size, config.seed)
optimizer = make_inner_optimizer(config, model.parameters())
part = data_part(config.data_split, config.seed, args.cluster_index, args.num_clusters)
sampler = BatchSampler(
    data.train, config.model.block_size, config.inner.batch_size, part.seed, part.index, part.count, split=part.split
)
step = 0

dx = DiLoCoX(
    model,
    servers=args.servers,
    config=config,
    cluster=args.cluster,
    num_clusters=args.num_clusters,
    tokenizer="byte",
    evaluate=lambda: evaluate_run(model, config, data.eval),
)
if args.resume:
    saved = torch.load(args.resume, weights_only=False)
    (
        model.load_state_dict(saved["model"]),
        optimizer.load_state_dict(saved["optim"]),
        sampler.load_state_dict(saved["sampler"]),
    )
    dx.load_state_dict(saved["dilocox"])
    step = saved["step"]
with dx:
    while not dx.done:
        model.train()
        for group in optimizer.param_groups:
            group["lr"] = inner_lr(config, step)
        optimizer.zero_grad(set_to_none=True)
        x, y = sampler.next_batch()
        loss = lm_loss(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.inner.grad_clip)
        optimizer.step()
        step += 1
        report = dx.step(tokens=x.numel(), loss=loss.detach())
        if report is not None and report.round == args.stop_after_round:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optim": optimizer.state_dict(),
                    "sampler": sampler.state_dict(),
                    "dilocox": dx.state_dict(),
                    "step": step,
                },
                args.out,
            )
            raise SystemExit(0)
    print(f"final_eval_loss={dx.final_eval_loss:.4f} rounds={len(dx.reports)}")
torch.save({name: p.detach().clone() for name, p in model.named_parameters()}, args.out)
