"""Refuse a malformed or absurd model before building it: every size field checked by name, then an
analytic estimate of its parameters, from the configuration alone (the bytes a layout needs are the
memory plan's: worker/site/size_guard.py).

Why before: building is where a bad size costs. A vocabulary of 10⁹ asked torch for 256 GB and died
with a traceback; 10⁶ layers grew to 11.8 GB of RSS over 83 s before the allocator gave up (on a smaller
machine the OOM killer ends it, and maybe its neighbours). Even the meta device builds one Python module
per layer, so the fields are bounded first, then an analytic estimate of the parameters, and only then is
the structure built on the meta device for the exact count; the bytes a layout needs come from the memory
plan (worker/site/memory_plan.py), the same that `dilocox plan` prints.
"""

from __future__ import annotations

from dilocox.common.config.run import ModelConfig
from dilocox.worker.models.spec import ModelSpec, ModelSpecError

# Far beyond any model trained today, short of sizes whose structure alone would take minutes to build.
MAX_LAYERS = 2048
MAX_WIDTH = 1 << 17  # hidden / intermediate size
MAX_HEADS = 4096
MAX_VOCAB = 1 << 23
MAX_POSITIONS = 1 << 22
MAX_PARAMS = 10**13

_HF_FIELDS = {  # config.json key -> (what it is, bound, may be absent/None)
    "vocab_size": ("vocabulary", MAX_VOCAB, False),
    "hidden_size": ("width", MAX_WIDTH, True),
    "n_embd": ("width", MAX_WIDTH, True),
    "intermediate_size": ("MLP width", MAX_WIDTH * 8, True),
    "n_inner": ("MLP width", MAX_WIDTH * 8, True),
    "num_hidden_layers": ("layers", MAX_LAYERS, True),
    "n_layer": ("layers", MAX_LAYERS, True),
    "num_attention_heads": ("heads", MAX_HEADS, True),
    "n_head": ("heads", MAX_HEADS, True),
    "num_key_value_heads": ("key/value heads", MAX_HEADS, True),
    "max_position_embeddings": ("positions", MAX_POSITIONS, True),
    "n_positions": ("positions", MAX_POSITIONS, True),
}


def count_text(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def gb_text(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _field(label: str, key: str, value: object, what: str, bound: int, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelSpecError(f"--model {label}: {key} must be a whole number ({what}), got {value!r}")
    if not 1 <= value <= bound:
        raise ModelSpecError(f"--model {label}: {key} = {value} is outside 1…{bound:,} ({what})")
    return value


def check_fields(spec: ModelSpec, config: ModelConfig) -> dict[str, int]:
    """Every size field of the model, by its own name: a whole number within bounds, widths divisible by
    heads. Returns the normalised sizes (layers, width, mlp, heads, vocab)."""
    if spec.kind == "gpt":
        for key, bound in (
            ("n_layer", MAX_LAYERS),
            ("n_embd", MAX_WIDTH),
            ("n_head", MAX_HEADS),
            ("block_size", MAX_POSITIONS),
            ("vocab_size", MAX_VOCAB),
        ):
            _field(spec.label, f"--{key.replace('_', '-')}", getattr(config, key), key, bound, False)
        return {"layers": config.n_layer, "width": config.n_embd, "mlp": 4 * config.n_embd, "vocab": config.vocab_size}
    if spec.kind != "hf":
        return {}  # module:function builds what it builds; the meta count below still bounds it
    data = spec.hf_config or {}
    sizes: dict[str, int] = {}
    for key, (what, bound, optional) in _HF_FIELDS.items():
        if key in data:
            value = _field(spec.label, key, data[key], what, bound, optional)
            if value is not None:
                sizes.setdefault(
                    {
                        "n_embd": "hidden_size",
                        "n_inner": "intermediate_size",
                        "n_layer": "num_hidden_layers",
                        "n_head": "num_attention_heads",
                        "n_positions": "max_position_embeddings",
                    }.get(key, key),
                    value,
                )
    width, heads = sizes.get("hidden_size"), sizes.get("num_attention_heads")
    if width and heads and width % heads:
        raise ModelSpecError(
            f"--model {spec.label}: hidden_size {width} is not divisible by num_attention_heads {heads}"
        )
    kv = sizes.get("num_key_value_heads")
    if kv and heads and heads % kv:
        raise ModelSpecError(
            f"--model {spec.label}: num_attention_heads {heads} is not divisible by num_key_value_heads {kv}"
        )
    width = width or 0
    return {
        "layers": sizes.get("num_hidden_layers", 0),
        "width": width,
        "mlp": sizes.get("intermediate_size", 4 * width),
        "vocab": sizes.get("vocab_size", 0),
    }


def estimate_params(sizes: dict[str, int], vocab: int) -> int:
    """An upper estimate from the sizes alone: attention 4d², a gated MLP 3·d·m per layer, embeddings and
    head 2·V·d (untied)."""
    if not sizes:
        return 0
    d, m, layers = sizes["width"], sizes["mlp"], sizes["layers"]
    return layers * (4 * d * d + 3 * d * m) + 2 * max(vocab, sizes["vocab"]) * d


def available_host_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
