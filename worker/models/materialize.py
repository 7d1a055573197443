"""Initial weights made where they live: a model built on the `meta` device, sharded, then each rank fills
only its own rows — the same values for every layout and for one process, from the run's seed.

Why not `torch.manual_seed(seed)` and the whole model on the CPU (how θ₀ was made before): every rank then
holds 4 B × P of host memory at start (2.24 TB per 8-GPU node at 70B) and a stage sits whole on one GPU
before FSDP shards it. Why not torch's device-side random generators on sharded tensors: their draws
depend on how a tensor is cut, so θ₀ would differ between layouts and the single process.

How θ₀ is defined instead — *per initialisation unit*, independent of layout:

* A unit is a module that owns parameters directly (a `Linear`, an `Embedding`, a norm), named by its
  path in the whole model (`blocks.3.attn.qkv`, `model.layers.3.self_attn.q_proj`; pipeline stages keep
  the full model's names, worker/train/pipeline_stage.py).
* Its values are drawn on the CPU from torch's generator seeded with `unit_seed(seed, name)` (a hash of
  the run seed and the name), by the model's own init function applied to a stand-in of the unit whose
  parameters are whole, fresh CPU tensors — then to a stand-in of each ancestor, up to the root, in which
  everything but the path to this unit stays on `meta`. That last part keeps inits that reach into
  children (GPT-2's attention re-draws its `c_proj` scaled) while a meta sibling draws nothing: an op on
  a meta tensor consumes no random numbers, so a unit's values depend on its name and the seed alone.
* Each rank copies the rows it holds (FSDP2's `Shard(0)` chunk, or all of them) to its device.

A rank therefore holds its shard plus one whole parameter on the host at a time. Buffers (rotary
frequencies, masks) are computed by the constructor as usual: `parameters_on_meta()` sends parameters to
meta as they are registered and leaves buffers real.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

InitFn = Callable[[nn.Module], None]


class MaterializeError(ValueError):
    """A model that cannot be materialised as asked (a meta buffer, a parameter sharded other than by rows)."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Construct a model with every parameter on the `meta` device and every buffer real.

    Parameters are moved to meta as a module registers them, before the constructor's own init runs on
    them, so that init costs nothing and the CPU tensor a constructor asked for is never written (its
    pages are never touched). Buffers are computed as the constructor computes them. Not thread-safe:
    it swaps `nn.Module.register_parameter` for the duration."""
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def unit_seed(seed: int, name: str) -> int:
    """The generator seed of the initialisation unit `name` in a run seeded `seed` (63 bits of sha256)."""
    digest = hashlib.sha256(f"dilocox-init/1\0{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def reset_parameters_init(module: nn.Module) -> None:
    """torch's convention, the default init of a model that brings none: each module's own `reset_parameters`."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def _meta_parameter(param: torch.Tensor) -> nn.Parameter:
    """A meta stand-in of `param` with its *whole* shape (a DTensor's shape is the global one)."""
    return nn.Parameter(
        torch.empty(tuple(param.shape), dtype=param.dtype, device="meta"), requires_grad=param.requires_grad
    )


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of `module` sharing its attributes but with dicts of its own for parameters, buffers and
    children (FSDP2's wrapper classes copy to their original class)."""
    clone = copy.copy(module)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = dict(module._modules)
    return clone


def meta_skeleton(module: nn.Module) -> nn.Module:
    """The tree of `module` with every parameter replaced by a meta tensor of its whole shape: costs no
    memory, whatever `module` holds (meta, materialised, FSDP-sharded), and draws no random numbers."""
    memo: dict[int, nn.Module] = {}

    def skeleton(m: nn.Module) -> nn.Module:
        if id(m) not in memo:
            clone = _shallow(m)
            clone._parameters = {n: None if p is None else _meta_parameter(p) for n, p in m._parameters.items()}
            clone._modules = {n: None if c is None else skeleton(c) for n, c in m._modules.items()}
            memo[id(m)] = clone
        return memo[id(m)]

    return skeleton(module)


def initial_values(skeleton: nn.Module, unit: str, init_fn: InitFn, seed: int) -> dict[str, torch.Tensor]:
    """The whole-shape initial values of the parameters the module `unit` owns directly (CPU, fp32 or the
    parameter's dtype): the model's `init_fn` on the unit, then on each ancestor towards the root, under
    a generator seeded by `unit_seed(seed, unit)`."""
    path = unit.split(".") if unit else []
    chain = [skeleton]
    for part in path:
        chain.append(chain[-1]._modules[part])
    stand_ins = [_shallow(m) for m in chain]
    for parent, child, part in zip(stand_ins, stand_ins[1:], path):
        parent._modules[part] = child
    leaf = stand_ins[-1]
    # NaN until drawn: an init that leaves a parameter untouched is caught, not trained from garbage.
    leaf._parameters = {
        n: None
        if p is None
        else nn.Parameter(torch.full(p.shape, float("nan"), dtype=p.dtype), requires_grad=p.requires_grad)
        for n, p in leaf._parameters.items()
    }
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(unit_seed(seed, unit))
        for module in reversed(stand_ins):
            init_fn(module)
    values = {n: p.detach() for n, p in leaf._parameters.items() if p is not None}
    for name, value in values.items():
        if value.is_floating_point() and bool(value.isnan().any()):
            raise MaterializeError(
                f"the model's init leaves {unit + '.' if unit else ''}{name} (a {type(chain[-1]).__name__}) "
                "without a value: its init function must set every parameter"
            )
    return values


def held_rows(rows: int, shard: int, shards: int) -> tuple[int, int]:
    """Rows [start, stop) of a `rows`-row parameter held by FSDP shard `shard` of `shards`
    (torch.chunk: ⌈rows / shards⌉ each, the last ones shorter or empty)."""
    chunk = math.ceil(rows / shards) if rows else 0
    return min(shard * chunk, rows), min((shard + 1) * chunk, rows)


def local_rows(param: torch.Tensor) -> slice:
    """The rows of the whole parameter this rank holds: FSDP2's `Shard(0)` chunk over the mesh dims that
    shard (torch.chunk's split: ⌈n / k⌉ rows a chunk, the last ones short or empty), all rows for a
    replicated dim or a plain tensor."""
    if not isinstance(param, DTensor):
        return slice(0, param.shape[0] if param.dim() else 1)
    rows = param.shape[0]
    start, stop = 0, rows
    mesh = param.device_mesh
    for dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not (isinstance(placement, Shard) and placement.dim == 0 and type(placement) is Shard):
            raise MaterializeError(
                f"a parameter of shape {tuple(param.shape)} is sharded as {param.placements}: "
                "only FSDP's row sharding (Shard(0)) is materialised"
            )
        first, last = held_rows(stop - start, mesh.get_local_rank(dim), mesh.size(dim))
        start, stop = start + first, start + last
    local = param.to_local()
    if local.dim() and local.shape[0] != stop - start:
        raise MaterializeError(
            f"a parameter of shape {tuple(param.shape)} holds {local.shape[0]} rows here, "
            f"not the {stop - start} of its Shard(0) chunk"
        )
    return slice(start, stop)


def _fill(param: torch.Tensor, whole: torch.Tensor) -> None:
    local = param.to_local() if isinstance(param, DTensor) else param
    if whole.dim() == 0:
        local.copy_(whole)
        return
    local.copy_(whole[local_rows(param)])


def parameter_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module owning parameters directly, in `named_modules` order: each shared
    parameter is made once, by its first owner."""
    units, seen = [], set()
    for name, m in module.named_modules():
        own = [p for p in m._parameters.values() if p is not None and id(p) not in seen]
        if own:
            seen.update(id(p) for p in own)
            units.append((name, m))
    return units


def materialize(
    module: nn.Module,
    device: torch.device | str,
    seed: int,
    init_fn: InitFn = reset_parameters_init,
    skeleton: nn.Module | None = None,
    fill: bool = True,
) -> nn.Module:
    """Give `module`'s meta parameters storage on `device` (each rank only its shard, where FSDP2 has
    sharded it) and, with `fill`, their initial values from `seed` (see the module docstring). Buffers keep
    the values the constructor computed. `skeleton`: the whole model's meta tree whose init this is, for
    a pipeline stage (default: `module`'s own). Returns `module`."""
    device = torch.device(device)
    buffers = dict(module.named_buffers())
    meta_buffers = [name for name, b in buffers.items() if b.is_meta]
    if meta_buffers:
        raise MaterializeError(
            f"buffer {meta_buffers[0]} is on the meta device, so its value is unknown: construct the "
            "model under dilocox.parameters_on_meta() (parameters on meta, buffers computed)"
        )
    skeleton = skeleton if skeleton is not None else meta_skeleton(module)
    module.to_empty(device=device)
    with torch.no_grad():
        for name, value in buffers.items():
            owner, _, key = name.rpartition(".")
            target = module.get_submodule(owner)._buffers[key]
            if target is not value:
                target.copy_(value)
        if fill:
            for unit, owner in parameter_units(module):
                values = initial_values(skeleton, unit, init_fn, seed)
                for name, param in owner._parameters.items():
                    if param is not None and name in values:
                        _fill(param, values[name])
    return module
