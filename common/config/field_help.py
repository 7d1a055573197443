"""One line of `--help` per run-configuration flag: what it takes and what it does.

Keyed by the flag's argparse destination (`rounds`, `inner__steps`); `add_field_argument` (run_flags.py)
appends the default. `tests/test_cli.py` checks that every RunConfig field has its line, so a new field
cannot ship with a bare type and default (argparse formats the lines: a literal percent sign is written %%).
The reasons behind the defaults live beside the fields (config/run.py, wire/compression.py) and in
docs/decisions.md.
"""

from __future__ import annotations

FIELD_HELP = {
    "run_id": "the run's name; shards serve one run and refuse clusters of another",
    "rounds": "outer rounds (syncs) in the run",
    "delay": "1: one-step-delay overlap (DiLoCoX: the exchange runs beside the next round); 0: synchronous DiLoCo",
    "overlap_steps": "with --delay 1 and --delayed-start own, take the previous round's merged model in from this "
    "many inner steps into the next round on, at the first step it is back (Streaming DiLoCo's τ; 0: at the round's "
    "end, the plain one-step delay)",
    "sync_rounds": "with --delay 1, make the first N rounds synchronous (a warm-up while pseudo-gradients are large)",
    "stale_weighting": "how work merged into a later round than it was trained for weighs (a late site): inverse "
    "(tokens × 1/(1 + age in rounds)), lenient (a round late counts whole, older 1/age) or full (its tokens); shards "
    "cap it at the on-time contributions' mean either way",
    "delayed_start": "where a delayed round's successor starts: own (θ_{t-1} − Δ_t), eager (Eager updates: θ_{t-1} − "
    "η/M·(Δ_t + μW), arXiv 2502.12996) or estimate (the outer step on an estimate of the round's mean)",
    "seed": "seeds the initial model, the data order and the compressor (the same on every cluster)",
    "eval_batches": "batches of the fixed eval windows behind every eval loss",
    "tokenizer": "byte (bytes are tokens), bpe:VOCAB (trained on the data, cached) or a path to a tokenizer.json",
    "data_split": "each cluster's part of the data: interleaved (round-robin chunks), contiguous (its own stretch), "
    "own (its own --data whole)",
    "model__model": "gpt (built-in), a preset (llama-tiny, llama-20m, gpt2-small, llama-350m, llama-1b), a "
    "config.json path, or module:function",
    "model__weights": "a local .safetensors file to start from instead of the seeded initialisation",
    "model__vocab_size": "vocabulary of the built-in GPT (the tokenizer's size wins where it differs)",
    "model__block_size": "tokens per training sequence (context length)",
    "model__n_layer": "transformer blocks of the built-in GPT",
    "model__n_head": "attention heads of the built-in GPT",
    "model__n_embd": "embedding width of the built-in GPT",
    "model__dropout": "dropout of the built-in GPT",
    "inner__steps": "H: inner AdamW steps per round, between syncs",
    "inner__batch_size": "sequences per batch (per data-parallel rank)",
    "inner__grad_accum": "batches whose gradients add up to one inner step",
    "inner__lr": "inner AdamW peak learning rate (warm-up, then cosine to 10%% over rounds × H steps)",
    "inner__weight_decay": "inner AdamW weight decay",
    "inner__beta1": "inner AdamW β1",
    "inner__beta2": "inner AdamW β2",
    "inner__grad_clip": "clip the gradient's global norm to this (0: no clipping)",
    "inner__warmup_steps": "inner steps of linear learning-rate warm-up",
    "inner__round_time_s": "time-boxed rounds: each site trains about this many seconds per round, its H set from its "
    "measured step time (0 = fixed H, the default)",
    "inner__min_steps": "with --inner-round-time-s: the fewest inner steps a round may have",
    "inner__adaptive_steps": "grow H (up to --inner-max-steps) when a round's exchange outlasts its compute; "
    "single-process sites only",
    "inner__max_steps": "the most inner steps per round --inner-adaptive-steps may grow H to",
    "outer__lr": "the shards' outer Nesterov learning rate (on the mean pseudo-gradient)",
    "outer__momentum": "the shards' outer Nesterov momentum",
    "wire__chunk_bytes": "bytes per gRPC message of a streamed tensor",
    "wire__zstd_level": "zstd level of every payload (1: fastest)",
    "wire__max_message_bytes": "the largest gRPC message either side accepts",
    "wire__replay_check": "check each replayed outer step against the shard's state digest, and pull in full on a "
    "mismatch",
    "wire__exchange_threads": "torch CPU threads of this rank's exchange (compression, replay, replay check); 0: the "
    "cores "
    "this rank may use, shared by the node's ranks, less the training's own threads (at least 1)",
    "wire__keepalive_s": "ping a connection silent this long; drop it if the ping goes unanswered as long again",
    "compress__codec": "uplink pseudo-gradients: lowrank (adaptive rank + quantised factors), int4, int8, bf16, fp16 "
    "or fp32 (none)",
    "compress__factor_bits": "bits of the quantised low-rank factors and of small tensors: 4, 8 or 32",
    "compress__rank_min": "the smallest rank a low-rank matrix gets",
    "compress__rank_max": "the largest rank a low-rank matrix gets",
    "compress__target_energy": "the smallest rank whose components capture this share of ‖Δ + e‖² is chosen",
    "compress__rank_window": "rounds over which the chosen rank is smoothed (the window's max)",
    "compress__adaptive_rank": "choose the rank per matrix and round (false: always --compress-rank-max)",
    "compress__min_lowrank_numel": "matrices smaller than this are only quantised, not factored",
    "compress__error_feedback": "carry what compression dropped into the next round (error feedback)",
    "compress__error_decay": "share of last round's residual carried into this one (1: classic error feedback)",
    "compress__local_residual": "keep the unsent residual in the cluster's own weights (trains on it, sends it once)",
    "compress__flush_codec": "dense codec (int4, int8, bf16, fp16, fp32) of the residuals' flush after the last "
    "round; none: no flush",
    "parallel__pp": "pipeline stages of the site (torchrun ranks: pp × dp)",
    "parallel__dp": "data-parallel ranks per stage (FSDP2)",
    "parallel__dp_replicate": "of the dp ranks, how many hold whole replicas: 1 = FSDP, dp = replication, between = "
    "HSDP",
    "parallel__microbatches": "micro-batches per batch through the pipeline (divides the batch size; 1f1b needs ≥ pp)",
    "parallel__schedule": "pipeline schedule: 1f1b, gpipe, interleaved-1f1b (with --stages-per-rank ≥ 2: a smaller "
    "bubble) or interleaved-zb (zero bubble: backward split into input and weight halves; --pipeline-reshard step)",
    "parallel__stages_per_rank": "pipeline stages each rank holds: 1, or with --schedule interleaved-1f1b 2 or more "
    "(the model cut into pp × this many stages, rank r holding r, r + pp, …)",
    "parallel__device": "auto (CUDA where there is one), cpu, cuda (each rank its LOCAL_RANK's GPU) or cuda:N (one "
    "process)",
    "parallel__activation_checkpoint": "none, selective (every other block) or full: recompute the transformer "
    "blocks' forward in the backward (activations: a checkpointed block keeps its input per token, not every "
    "intermediate)",
    "parallel__compile": "off, or blocks: each transformer block's forward compiled by torch.compile (inductor), in "
    "place — the same parameter names, FSDP2 units and activation checkpointing; the first steps wait for the "
    "compiler",
    "parallel__optimizer_state": "AdamW's two moments: fp32 (8 B per parameter), bf16 (4 B) or int8 (8-bit, a scale "
    "per block of a row: ~2 B; needs torchao, pip install 'dilocox[site]'); weights and gradients stay fp32",
    "parallel__pipeline_reshard": "with --pp > 1 and FSDP: step (blocks stay gathered through the step: fewer "
    "collectives, ~6 B per stage parameter per GPU), microbatch (reshard and reduce every microbatch: unpipelined "
    "FSDP's memory) or auto (step where the memory plan says it fits)",
    "parallel__spill_dir": "a directory on this node's local disk (NVMe): the round's start lives in a file there "
    "between boundaries, not in host memory (12 instead of 16 host bytes per exchanged parameter, the same bits; one "
    "write and one read of 4 B per parameter a round); empty: host memory",
    "parallel__checkpoint_staging": "async (the site checkpoint is staged into host buffers kept for the next one, "
    "pinned on GPUs, and written in the background) or sync (written from the live state while the site waits: no "
    "staging memory)",
    "parallel__precision": "auto (bf16 on GPUs that compute in it natively, else fp32), fp32 or bf16; weights and "
    "exchange stay fp32",
}
