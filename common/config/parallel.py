"""How one cluster computes — its device and precision, pipeline stages × data-parallel ranks, the pipeline
schedule, AdamW's state and the site's memory savers — as a typed dataclass of the run configuration
(`RunConfig.parallel`; flags without a prefix: `--pp`, `--schedule`, `--optimizer-state`). Its own checks
refuse a layout torch would fail on deep inside a schedule, with the flag to change."""

from __future__ import annotations

from dataclasses import dataclass

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb")
COMPILE_MODES = ("off", "blocks")
# none | selective (every other block: 0, 2, 4, … of each rank) | full (every block)
ACTIVATION_CHECKPOINTS = ("none", "selective", "full")


@dataclass(frozen=True)
class ParallelConfig:
    """How one cluster computes: its device and precision, pipeline stages × data-parallel ranks
    (NCCL between GPUs, gloo on CPU — the same code; worker/site/)."""

    pp: int = 1  # pipeline stages (torch.distributed.pipelining)
    dp: int = 1  # data-parallel ranks of each stage (FSDP2: fully_shard on the stage's DeviceMesh)
    # Of the dp ranks, how many hold whole replicas: 1 = every stage fully sharded over its dp ranks (FSDP),
    # dp = plain replication (DDP-style, for a stage that fits one GPU), in between = HSDP (replicas of
    # dp / dp_replicate-way shards). Must divide dp.
    dp_replicate: int = 1
    microbatches: int = 4  # per inner step, through the pipeline (must divide the batch size; 1f1b: ≥ pp)
    # gpipe | 1f1b | interleaved-1f1b (torch's ScheduleInterleaved1F1B over `stages_per_rank` stages a rank:
    # the bubble (pp − 1) / (v·m + pp − 1) instead of (pp − 1) / (m + pp − 1)) | interleaved-zb (torch's
    # ScheduleInterleavedZeroBubble: each backward split into its input's and its weights' halves, the
    # latter filling the bubble; blocks stay gathered through the step, --pipeline-reshard step)
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    device: str = "auto"  # auto (cuda where there is one) | cpu | cuda | cuda:N (one process only)
    # auto: bf16 on GPUs that compute in it natively (compute capability ≥ 8), fp32 elsewhere. Weights,
    # AdamW state and everything sent to the shards stay fp32 either way (worker/train/device.py).
    precision: str = "auto"  # auto | fp32 | bf16
    # none | selective | full: recompute each transformer block's forward in the backward (torch.utils.checkpoint),
    # so a block keeps only its input per token instead of every intermediate: what makes 70B fit at long blocks.
    # selective: every other block (torchtitan's layer-wise selective checkpointing at frequency 2): about half
    # the activations for half of full's recompute.
    activation_checkpoint: str = "none"
    # With --pp > 1 and FSDP: "step" keeps each block gathered, and its gradients unsharded, from its first
    # microbatch to the end of the step (one all-gather and one reduce-scatter per block and step: torch's
    # pipelining default, ~6 B per stage parameter on every GPU); "microbatch" reshards after every
    # microbatch's forward and backward and reduces each microbatch's gradients (the memory of unpipelined
    # FSDP, microbatches × the collectives); "auto": "step" where the memory plan says it fits the GPU.
    pipeline_reshard: str = "auto"
    # A directory on this node's local disk: the round's start s_t (4 B per exchanged parameter) lives in a
    # file there between boundaries instead of host memory — 12 exchange bytes per owned parameter instead
    # of 16, the same bits (worker/exchange/spill.py). "": host memory.
    spill_dir: str = ""
    # async: the site checkpoint is staged into host buffers kept for the next one (pinned on GPUs) and
    # written in the background; sync: written from the live state while the site waits — no staging memory
    # (worker/checkpoint.py).
    checkpoint_staging: str = "async"
    # AdamW's two moments: fp32 (torch's AdamW, 8 B per parameter), bf16 (4 B) or int8 (8-bit with a scale per
    # block of a row, ~2 B; torchao, the site's extra): worker/train/light_adamw.py.
    optimizer_state: str = "fp32"
    # off | blocks: each transformer block's forward through torch.compile (inductor), in place — parameter
    # names, FSDP2 units and activation checkpointing stay as they are (worker/site/parallelize.py). Off by
    # default: the first steps wait for the compiler (tens of seconds per distinct block on a CPU).
    compile: str = "off"

    def __post_init__(self) -> None:
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.optimizer_state not in ("fp32", "bf16", "int8"):
            raise ValueError(f"optimizer_state must be fp32, bf16 or int8, got {self.optimizer_state!r}")
        if self.device not in ("auto", "cpu", "cuda") and not (
            self.device.startswith("cuda:") and self.device[5:].isdigit()
        ):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision must be auto, fp32 or bf16, got {self.precision!r}")
        if self.pipeline_reshard not in ("auto", "step", "microbatch"):
            raise ValueError(f"pipeline_reshard must be auto, step or microbatch, got {self.pipeline_reshard!r}")
        if self.checkpoint_staging not in ("async", "sync"):
            raise ValueError(f"checkpoint_staging must be async or sync, got {self.checkpoint_staging!r}")
        if self.activation_checkpoint not in ACTIVATION_CHECKPOINTS:
            raise ValueError(
                f"activation_checkpoint must be none, selective or full, got {self.activation_checkpoint!r}"
            )
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"pp and dp must be ≥ 1, got pp={self.pp} dp={self.dp}")
        if self.dp_replicate < 1 or self.dp % self.dp_replicate:
            raise ValueError(
                f"dp_replicate must be ≥ 1 and divide dp, got dp_replicate={self.dp_replicate} dp={self.dp}"
            )
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(PIPELINE_SCHEDULES)}, got {self.schedule!r}")
        if (
            self.stages_per_rank < 1
            or (self.stages_per_rank > 1 and not self.schedule.startswith("interleaved"))
            or (self.schedule == "interleaved-1f1b" and self.stages_per_rank == 1)
        ):
            raise ValueError(
                f"--stages-per-rank {self.stages_per_rank} with --schedule {self.schedule}: more than one stage a rank "
                "is the interleaved schedules' (--schedule interleaved-1f1b --stages-per-rank 2 or more, or "
                "interleaved-zb)"
            )
        if self.schedule == "interleaved-zb" and self.pipeline_reshard == "microbatch":
            raise ValueError(
                "--schedule interleaved-zb splits each backward in two, which --pipeline-reshard microbatch cannot "
                "reshard between: use --pipeline-reshard step (or auto)"
            )
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be ≥ 1, got {self.microbatches}")
        if self.schedule == "1f1b" and self.pp > 1 and self.microbatches < self.pp:
            # torch's Schedule1F1B needs every stage to hold a microbatch in its warm-up; with fewer it
            # fails deep inside the schedule at the first step.
            raise ValueError(
                f"schedule 1f1b needs at least as many microbatches as stages: --pp {self.pp} with --microbatches "
                f"{self.microbatches}; use --microbatches {self.pp} (or more, dividing the batch size) or --schedule "
                "gpipe"
            )
        if self.world_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(
                f"--device {self.device} would put all {self.world_size} ranks of this site on one GPU; with --pp/--dp "
                "use --device cuda (or auto): each rank takes the GPU of its LOCAL_RANK"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def dp_shard(self) -> int:
        """How many ways each stage's parameters are sharded (FSDP's shard dimension)."""
        return self.dp // self.dp_replicate
