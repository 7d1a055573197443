"""AdamW whose two moments are light: `--optimizer-state bf16` (2 B each) or `int8` (1 B each and a block
scale), so that a 16 × 80 GB site holds a 70B model (docs/performance.md, "What fits a site").

fp32 AdamW keeps 16 B of sharded state per parameter (fp32 weight, gradient and two moments); bf16 moments
make it 12, 8-bit moments about 10. The weights and the gradients stay fp32 (the exchange reads the
weights; the shards never learn how a site keeps its optimizer).

The arithmetic is torchao's (`torchao.optim`, an optional extra of the site, never of the shards): its
per-parameter AdamW step computes in fp32 and writes the moments back in their own format, and its 8-bit
state (`OptimState8bit`) is bitsandbytes' dynamic-tree quantisation with a block-wise absmax scale, which
keeps the second moment's wide range where linear int8 would not. What this class adds over torchao's own
`AdamW8bit`:

* **Blocks never cross a row.** The block is the largest of 256, 128, 64 that divides a row (torchao's
  flat blocks may straddle rows), so a moment's scales form a (rows, row / block) matrix that shards by
  rows exactly like its parameter: the checkpoint writes codes and scales as DTensors with the
  parameter's placements, and a resume with another layout reshards them (DCP). A parameter without such
  a row (1-D norms and biases, narrow matrices) keeps fp32 moments, as torchao does for small tensors.
* **Its state is the rank's local shard**, plain tensors; only `state_dict` wraps them as DTensors for
  DCP, and `load_state_dict` takes them back without the fp32 copy of every moment that `Optimizer`'s
  own would make (it casts every state tensor to the parameter's dtype: at 70B, 35 GB per GPU).
* **Compiled on GPUs, and for large tensors on the CPU.** torchao always compiles its step; on a GPU that
  is one fused kernel per parameter (no fp32 transient of a whole moment). On the CPU inductor needs tens
  of seconds per parameter shape to compile, which small tensors (and tests) never win back, while eager
  costs ~12× more per element (torchao's 8-bit quantiser is a binary search of 8 gathers): a parameter's
  step is compiled from `CPU_COMPILE_NUMEL` elements of this rank's rows on. Every rank holding the same
  rows (HSDP's replicas) decides alike.

Replicas of a stage (HSDP, plain replication) step the same rows from the same gradients with the same
code and so stay bit-identical, as fp32 AdamW does.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from dilocox.common.logs import quiet_import_noise

OPTIMIZER_STATES = ("fp32", "bf16", "int8")
INT8_BLOCKS = (256, 128, 64)  # tried largest first; each must divide a row
INT8_MIN_NUMEL = 4096  # smaller tensors keep fp32 moments (torchao's and bitsandbytes' rule)
# On the CPU a parameter's step is compiled from this size on: eager, torchao's 8-bit step costs ~250 ns an
# element (4.2 s for 16M), compiled ~20 (after ~15 s of compiling per shape, cached on disk by inductor):
# from 262,144 elements (a 512 × 512 matrix) on, a run of a few hundred steps wins it back.
CPU_COMPILE_NUMEL = 1 << 18
_MOMENTS = ("exp_avg", "exp_avg_sq")  # torch's names, so checkpoints and tools read the same keys


class OptimizerStateError(ValueError):
    """An optimizer state this installation cannot keep (torchao missing)."""


@functools.lru_cache(maxsize=4096)
def int8_block(shape: tuple[int, ...]) -> int | None:
    """The 8-bit block of a parameter of global `shape`, or None: its moments stay fp32. Decided on the
    global shape so that every rank and every layout agrees."""
    if len(shape) < 2 or math.prod(shape) < INT8_MIN_NUMEL:
        return None
    row = math.prod(shape[1:])
    return next((b for b in INT8_BLOCKS if row % b == 0), None)


def moment_bytes(shape: tuple[int, ...], held: int, state: str) -> int:
    """Bytes of both moments of a parameter of global `shape` of which a rank holds `held` elements (its
    rows): what `dilocox plan` counts."""
    if state == "fp32":
        return 8 * held
    if state == "bf16":
        return 4 * held
    block = int8_block(shape)
    if block is None:
        return 8 * held
    return 2 * held + 2 * 4 * (held // block)  # codes, and an fp32 scale per block, for each moment


def optimizer_state_of(optimizer: torch.optim.Optimizer) -> str:
    """fp32, bf16 or int8: how `optimizer` keeps AdamW's moments (worker/train/light_adamw.py)."""
    return getattr(optimizer, "moment_state", "fp32")


@functools.cache
def _torchao():
    """(single_param_adam, OptimState8bit, qmap builder) from torchao, or OptimizerStateError."""
    quiet_import_noise()
    try:
        from torchao.optim.adam import single_param_adam
        from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned
    except ImportError as error:
        raise OptimizerStateError(
            f"--optimizer-state bf16/int8 needs torchao ({error}); install the site's extra: pip install "
            "'dilocox[site]'"
        ) from None
    return single_param_adam, OptimState8bit, (get_qmap_signed, get_qmap_unsigned)


def require_torchao() -> None:
    """Refuse early (before a site builds its model) where torchao cannot be imported."""
    _torchao()


@functools.cache
def _compiled_step():
    single_param_adam = _torchao()[0]
    return torch.compile(single_param_adam, fullgraph=True, dynamic=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _as_like(local: torch.Tensor, param: torch.Tensor, rows_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """`local` wrapped as a DTensor sharded like `param` (its global shape, or `rows_shape`: the same
    rows, another row length); plain where `param` is plain."""
    if not isinstance(param, DTensor):
        return local
    shape = torch.Size(rows_shape or param.shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))  # contiguous
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=shape, stride=stride)


class LightAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, torch's defaults otherwise) with moments in `state`: "bf16" or
    "int8" (see the module docstring). `compiled`: run torchao's step through torch.compile (default: on
    CUDA, and on the CPU for parameters of `CPU_COMPILE_NUMEL` elements or more)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state: str = "int8",
        compiled: bool | None = None,
    ) -> None:
        if state not in ("bf16", "int8"):
            raise ValueError(f"LightAdamW keeps bf16 or int8 moments, not {state!r} (fp32: torch.optim.AdamW)")
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"LightAdamW: invalid lr {lr}, eps {eps} or betas {betas}")
        self._step_fn, self._state8, self._qmaps = _torchao()
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.moment_state = state
        self.compiled = compiled
        self._qmap_cache: dict[tuple[torch.device, bool], torch.Tensor] = {}

    # ------------------------------------------------------------------ the moments
    def _qmap(self, device: torch.device, signed: bool) -> torch.Tensor:
        key = (device, signed)
        if key not in self._qmap_cache:
            values = self._qmaps[0]() if signed else self._qmaps[1]()
            self._qmap_cache[key] = torch.tensor(values, dtype=torch.float32, device=device)
        return self._qmap_cache[key]

    def _zeros(self, param: torch.Tensor) -> dict:
        local = _local(param)
        state: dict = {"step": torch.zeros((), dtype=torch.float32)}
        block = int8_block(tuple(param.shape)) if self.moment_state == "int8" else None
        for name in _MOMENTS:
            if block is not None:  # a scale per block of each row: (rows, row / block)
                scales = (local.shape[0], math.prod(local.shape[1:]) // block)
                state[name] = {
                    "codes": torch.zeros(local.shape, dtype=torch.uint8, device=local.device),
                    "scale": torch.zeros(scales, dtype=torch.float32, device=local.device),
                }
            else:
                dtype = torch.bfloat16 if self.moment_state == "bf16" else torch.float32
                state[name] = torch.zeros(local.shape, dtype=dtype, device=local.device)
        return state

    def _moment(self, value, signed: bool):  # noqa: ANN001, ANN202
        """What torchao's step takes: a plain tensor, or an 8-bit state made of the kept codes and scale."""
        if not isinstance(value, dict):
            return value
        codes, scale = value["codes"], value["scale"]
        return self._state8(codes, scale.view(-1), self._qmap(codes.device, signed), signed)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = torch.tensor(float(group["lr"]), dtype=torch.float32)
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state.update(self._zeros(param))
                state["step"] += 1
                local, grad = _local(param), _local(param.grad)
                if local.numel() == 0:  # FSDP gave this rank none of the rows
                    continue
                compiled = (
                    self.compiled
                    if self.compiled is not None
                    else (local.device.type == "cuda" or local.numel() >= CPU_COMPILE_NUMEL)
                )
                step_fn = _compiled_step() if compiled else self._step_fn
                step_fn(
                    local.detach(),
                    grad,
                    state["step"],
                    self._moment(state["exp_avg"], True),
                    self._moment(state["exp_avg_sq"], False),
                    None,
                    lr,
                    beta1,
                    beta2,
                    group["weight_decay"],
                    group["eps"],
                    True,
                    False,
                )
        return loss

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """torch's layout (state by parameter index, then param_groups), each moment a DTensor sharded like
        its parameter — an 8-bit one as {"codes", "scale"}, the scale one per block of each row — so DCP
        writes each rank's rows once and reshards them for another layout."""
        params = [p for group in self.param_groups for p in group["params"]]
        state = {}
        for index, param in enumerate(params):
            kept = self.state.get(param)
            if not kept:
                continue
            entry = {"step": kept["step"]}
            for name in _MOMENTS:
                value = kept[name]
                if isinstance(value, dict):
                    rows = (param.shape[0], math.prod(param.shape[1:]) // int8_block(tuple(param.shape)))
                    entry[name] = {
                        "codes": _as_like(value["codes"], param),
                        "scale": _as_like(value["scale"], param, rows),
                    }
                else:
                    entry[name] = _as_like(value, param)
            state[index] = entry
        groups, start = [], 0
        for group in self.param_groups:
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = list(range(start, start + len(group["params"])))
            start += len(group["params"])
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inverse of `state_dict`, in place where the values are this optimizer's own tensors (a DCP
        load into `state_dict()`'s views), without a transient copy of the whole state."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, self.param_groups)
        ):
            raise ValueError("LightAdamW.load_state_dict: the saved parameter groups do not match this optimizer's")
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for index, param in zip(saved["params"], group["params"]):
                entry = state_dict["state"].get(index)
                if entry is None:
                    continue
                fresh = self._zeros(param)
                fresh["step"] = torch.as_tensor(entry["step"], dtype=torch.float32).detach().clone().cpu()
                for name in _MOMENTS:
                    fresh[name] = self._restored(fresh[name], entry[name], name)
                self.state[param] = fresh

    def _restored(self, empty, saved, name: str):  # noqa: ANN001, ANN202
        if isinstance(empty, dict) != isinstance(saved, dict):
            raise ValueError(
                f"LightAdamW.load_state_dict: {name} was saved as another optimizer state "
                "(--optimizer-state differs from the checkpoint's)"
            )
        if isinstance(empty, dict):
            return {k: self._restored(empty[k], saved[k], f"{name}.{k}") for k in empty}
        local = _local(saved).detach()
        if local.shape != empty.shape:
            raise ValueError(
                f"LightAdamW.load_state_dict: {name} has shape {tuple(local.shape)}, this rank holds "
                f"{tuple(empty.shape)}"
            )
        if local.dtype != empty.dtype or local.device != empty.device:
            return local.to(device=empty.device, dtype=empty.dtype)
        return local
