"""A Hugging Face `Trainer` run as one DiLoCoX site: a tiny Llama built from its config (no hub), bytes
as tokens. The Trainer keeps its optimizer, schedule and logging; the callback syncs every H steps.

    dilocox server --port 50051 --run-id hf-trainer --min-clusters 2 --insecure &
    python examples/hf_trainer.py --site 0 & python examples/hf_trainer.py --site 1
"""

import argparse
import importlib.resources
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from dilocox import DiLoCoX, DiLoCoXCallback, InnerConfig, RunConfig

parser = argparse.ArgumentParser()
parser.add_argument("--servers", default="127.0.0.1:50051")
parser.add_argument("--site", type=int, default=0)
parser.add_argument("--sites", type=int, default=2)
parser.add_argument("--rounds", type=int, default=4)
parser.add_argument("--steps", type=int, default=10, help="inner steps per round (H)")
args = parser.parse_args()

text = importlib.resources.files("dilocox.common").joinpath("data/tinyshakespeare.txt").read_bytes()
blocks = torch.tensor(list(text), dtype=torch.long)[: len(text) // 64 * 64].view(-1, 64).chunk(args.sites)[args.site]
dataset = [{"input_ids": block, "labels": block} for block in blocks]  # each site its own part of the text

model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
)
model.to("cuda" if torch.cuda.is_available() else "cpu")  # before DiLoCoX: it reads the parameters where they live
config = RunConfig(run_id="hf-trainer", rounds=args.rounds, inner=InnerConfig(steps=args.steps))
site = DiLoCoX(model, servers=args.servers, config=config, cluster=f"hf-site-{args.site}", num_clusters=args.sites)
training = TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    max_steps=args.rounds * args.steps,
    per_device_train_batch_size=8,
    learning_rate=3e-3,
    lr_scheduler_type="constant",
    logging_steps=args.steps,
    report_to=[],
    save_strategy="no",
    include_num_input_tokens_seen="all",
    disable_tqdm=True,
)
with site:
    Trainer(model=model, args=training, train_dataset=dataset, callbacks=[DiLoCoXCallback(site)]).train()
print(f"hf-site-{args.site} done={site.done} rounds={len(site.reports)} tokens={sum(r.tokens for r in site.reports)}")
