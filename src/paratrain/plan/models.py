"""Model shapes the planner reasons about: presets, TOML configs, Hugging Face config.json.

A ``ModelSpec`` is a ``ModelShape`` (``models/shape.py``: the shape vocabulary train and
plan share, including the fields for GPT-3, GPT-2, GPT-NeoX and BLOOM style blocks) with
its name and the per-stage counts the planner needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path

from ..models import CUSTOM, shape_base
from ..models.shape import ModelShape, default_ffn
from . import mla, moe
from .keys import cached_hash
from .mla import LatentAttention


@dataclass(frozen=True)
class ModelSpec(ModelShape):
    """A model the planner reasons about: its shape (``ModelShape``, every field shared
    with ``GPTConfig``), its name, and the per-stage counts of a pipeline cut."""

    def __hash__(self) -> int:  # a search cache key: hashed once (plan/keys.py)
        return cached_hash(self)

    name: str = field(default="", kw_only=True)
    """Preset name or the file it came from."""
    preset: str = field(default="", compare=False, kw_only=True)
    """The ``paratrain train`` preset this model was read as (a train config's ``preset``,
    or the Hugging Face directory of a ``config.json``), written back by ``--out`` so that
    train builds it, and loads its weights; "" for a shape given field by field."""
    carried: tuple[tuple[str, object], ...] = field(default=(), compare=False, kw_only=True)
    """``GPTConfig`` settings read from a train config that change neither memory nor time
    (rope_theta, ...): not modelled, but written back by ``--out`` so that the exported
    config trains the same model."""
    mla: LatentAttention | None = field(default=None, kw_only=True)
    """DeepSeek's multi-head latent attention in place of standard attention (``plan/mla.py``;
    planner-only: ``train`` builds none); None: standard multi-head / grouped-query attention."""

    @lru_cache(maxsize=64)  # noqa: B019 - as ModelShape's
    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one block on one TP rank, with MLA's attention where it has it."""
        n = ModelShape.layer_params(self, tp)
        return n if self.mla is None else n + mla.params_delta(self, tp)

    def stage_layers(self, pp: int, stage: int, v: int = 1) -> int:
        """Blocks one rank of pipeline ``stage`` holds: evenly when pp x v divides the
        layers, else balanced with the embedding and head counted (``paratrain.stages``,
        the rule ``train`` cuts by)."""
        return self.stage_layer_counts(pp, v)[stage]

    @lru_cache(maxsize=1 << 14)  # noqa: B019 - the search asks for the same stages often
    def stage_params(self, tp: int, pp: int, stage: int, v: int = 1) -> int:
        """Parameters one rank of pipeline ``stage`` holds."""
        n = self.stage_layers(pp, stage, v) * self.layer_params(tp)
        if self.n_experts:  # its MoE blocks' router and shared expert for the dense MLP
            n += self.stage_moe_layers(pp, stage, v) * moe.replicated_delta(self, tp)
        if stage == 0:
            n += self.embedding_params(tp)
        if stage == pp - 1:
            n += self.head_params(tp, own_copy=pp > 1 and self.tie_embeddings)
        return n

    @lru_cache(maxsize=1 << 14)  # noqa: B019 - as stage_params
    def stage_moe_layers(self, pp: int, stage: int, v: int = 1) -> int:
        """Mixture-of-experts blocks one rank of pipeline ``stage`` holds (virtual stages
        stage, stage + pp, ...; 0 for a dense model)."""
        return sum(map(self.is_moe, self.stage_blocks(pp, stage, v))) if self.n_experts else 0

    def stage_blocks(self, pp: int, stage: int, v: int = 1) -> list[int]:
        """The blocks one rank of pipeline ``stage`` holds, in model order."""
        runs = self.stage_runs(pp, v)
        return [i for c in range(stage, pp * v, pp) for i in runs[c]]

    @lru_cache(maxsize=1 << 14)  # noqa: B019 - as stage_params
    def stage_expert_params(self, pp: int, stage: int, v: int = 1, ep: int = 1) -> int:
        """Routed-expert parameters one rank of pipeline ``stage`` holds: n_experts / ep
        experts of each of its MoE blocks (sharded by ZeRO over dp x cp / ep, not dp x cp).
        ``stage_params`` counts everything else."""
        return self.stage_moe_layers(pp, stage, v) * moe.expert_params(self) // ep

    def gpt_fields(self, seq_len: int = 0) -> dict:
        """The ``GPTConfig`` fields of paratrain's model with this shape."""
        return {"vocab_size": self.vocab_size, "d_model": self.d_model,
                "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "ffn_hidden": self.ffn_hidden,
                "max_seq_len": max(self.max_seq_len, seq_len),
                "tie_embeddings": self.tie_embeddings,
                **({"qkv_bias": True} if self.qkv_bias else {}),
                **({"qk_norm": True} if self.qk_norm else {}), **moe.gpt_fields(self),
                **dict(self.carried)}


_GPT_STYLE = dict(gated_mlp=False, bias=True, norm="layernorm")
PRESETS: dict[str, ModelSpec] = {
    "gpt3-175b": ModelSpec(96, 12288, 96, 96, 4 * 12288, 50257, 2048,
                           tie_embeddings=True, learned_pos=True, dropout=True, **_GPT_STYLE, name="gpt3-175b"),
    "bloom-176b": ModelSpec(70, 14336, 112, 112, 4 * 14336, 250880, 2048,
                            tie_embeddings=True, **_GPT_STYLE, name="bloom-176b"),
    "llama3-8b": ModelSpec(32, 4096, 32, 8, 14336, 128256, 8192, name="llama3-8b"),
    "llama3-70b": ModelSpec(80, 8192, 64, 8, 28672, 128256, 8192, name="llama3-70b"),
    "llama3-405b": ModelSpec(126, 16384, 128, 8, 53248, 128256, 8192, name="llama3-405b"),
}
LOCAL_PRESETS = ("tiny", "small")
"""paratrain's own GPTs, read from ``paratrain.models.gpt.PRESETS`` when asked for (that
module imports torch, so it is not imported otherwise)."""
TRAIN_PRESETS = (*LOCAL_PRESETS, "llama3-8b", "llama3-70b", "llama3-405b")
"""Presets ``paratrain train --model`` builds at the same shape (``models.gpt.PRESETS``),
so a config written by ``plan --out`` keeps the name."""


def from_gpt_config(cfg, name: str) -> ModelSpec:
    """The spec of paratrain's GPT built from a ``GPTConfig``: its ``shape``, named."""
    return of_shape(cfg.shape, name)


def of_shape(shape: ModelShape, name: str, **extra) -> ModelSpec:
    """``shape`` as a ``ModelSpec`` named ``name`` (``extra``: its preset, carried fields)."""
    return ModelSpec(**{f.name: getattr(shape, f.name) for f in fields(ModelShape)}, name=name, **extra)


def _local_preset(name: str) -> ModelSpec | None:
    try:
        from ..models.gpt import PRESETS as GPT_PRESETS
    except ImportError:
        return None
    return from_gpt_config(GPT_PRESETS[name], name) if name in GPT_PRESETS else None


def load_model(spec: str) -> ModelSpec:
    """A preset name, a ``.toml`` model config, or a Hugging Face ``config.json`` (or the
    directory holding one)."""
    if spec in PRESETS:
        return PRESETS[spec]
    path = Path(spec)
    if spec.endswith((".toml", ".json")) or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model config {path} does not exist")
        if path.suffix == ".toml":
            return from_toml(path)
        from .hf_config import from_hf_config

        return from_hf_config(path)
    found = _local_preset(spec)
    if found is None:
        known = ", ".join([*PRESETS, *LOCAL_PRESETS])
        raise ValueError(f"unknown model {spec!r}; give a preset ({known}), "
                         f"a .toml model config or a Hugging Face config.json path")
    return found


# ---- TOML ---------------------------------------------------------------------------------

MOE_FIELDS = ("n_experts", "top_k", "expert_ffn", "shared_ffn", "moe_first_dense")
"""A mixture of experts' shape fields, 0 in a dense model."""

_IGNORED_GPT_FIELDS = (
    "rope_theta", "rope_scaling",  # rotary frequencies: the same tensors and FLOPs
    "norm_eps", "init_std",  # values, not shapes
    # paratrain computes full attention and refuses sequences longer than the window, so
    # every run train accepts costs what the planner counts without it.
    "sliding_window",
    # how a mixture of experts routes and balances: values, not shapes (the experts, top_k
    # and widths are the shape's; a dense plan carries the defaults)
    "router", "norm_topk", "routed_scale", "aux_loss_coef", "bias_update", "capacity_factor",
)
"""``GPTConfig`` fields that change neither memory nor time; every other field is
modelled (``qkv_bias`` is a ``ModelSpec`` field). tests/test_plan_ux.py checks that each
``GPTConfig`` field is one or the other."""


def from_toml(path: str | Path) -> ModelSpec:
    """Read the ``[model]`` table of a train config, or top-level fields of a model file:
    ``ModelSpec`` field names; ``n_kv_heads`` / ``ffn_hidden`` of 0 mean what they mean in
    ``GPTConfig``. As ``paratrain train`` reads it, a ``[model]`` table starts from the
    preset ``models.shape_base`` names and overrides that preset's fields."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    table = data.get("model", data)
    if not isinstance(table, dict):
        raise ValueError(f"{path}: [model] must be a table of model settings")
    table = dict(table)
    preset = ""
    if "model" in data or "preset" in table:
        name = shape_base(table, table.pop("preset", None))  # as `paratrain train` reads it
        if name != CUSTOM:
            table, preset = {**_preset_fields(path, name), **table}, name
    carried = tuple((key, table.pop(key)) for key in _IGNORED_GPT_FIELDS if key in table)
    # set by the reader (mla: from a DeepSeek config.json only)
    known = {f.name for f in fields(ModelSpec)} - {"name", "preset", "carried", "mla"}
    unknown = sorted(k for k in table if k not in known and not isinstance(table[k], dict))
    if unknown:
        raise ValueError(f"{path}: unknown model fields {unknown}; known: {sorted(known)}")
    missing = [k for k in ("n_layers", "d_model", "n_heads") if k not in table]
    if missing:
        raise ValueError(f"{path}: the model needs {missing} (or a preset = NAME to start "
                         f"from, as in a train config's [model] table)")
    values = {"vocab_size": 256, "max_seq_len": 256, "n_kv_heads": 0, "ffn_hidden": 0,
              **{k: v for k, v in table.items() if k in known}}
    check_values(path, values, zero_ok=("n_kv_heads", "ffn_hidden", *MOE_FIELDS))
    if values.get("n_experts"):  # GPTConfig's defaults: top_k 2, experts as wide as ffn_hidden
        values["top_k"] = values.get("top_k") or 2
        values["ffn_hidden"] = values["ffn_hidden"] or default_ffn(values["d_model"])
        values["expert_ffn"] = values.get("expert_ffn") or values["ffn_hidden"]
        moe.check_shape(path, values)
    else:
        values["top_k"] = 0  # a dense model routes nothing (GPTConfig's default 2 is for experts)
    values["n_kv_heads"] = values["n_kv_heads"] or values["n_heads"]
    values["ffn_hidden"] = values["ffn_hidden"] or default_ffn(values["d_model"])
    return ModelSpec(name=path.name, **values, preset=preset, carried=carried)


def _preset_fields(path: Path, name: object) -> dict:
    """The ``GPTConfig`` fields of ``preset = name`` as ``paratrain train`` resolves it
    (``models.gpt.preset``: paratrain's presets or a Hugging Face model directory)."""
    if not isinstance(name, str):
        raise ValueError(f"{path}: preset must be a preset name in quotes, got {name!r}")
    try:
        from ..models.gpt import preset
    except ImportError as exc:  # the planner runs without torch; presets need it
        raise ValueError(f"{path}: preset = {name!r} needs paratrain's models ({exc}); "
                         f"give the model's fields instead of a preset") from None
    try:
        cfg = preset(name)
    except ValueError as err:
        raise ValueError(f"{path}: preset: {err}") from None
    return {f.name: getattr(cfg, f.name) for f in fields(cfg)}


def check_values(path: Path, values: dict, names: dict | None = None,
                 zero_ok: tuple[str, ...] = ()) -> None:
    """Every integer field of ``ModelSpec`` in ``values`` is an integer (JSON ``true`` is
    not 1 layer, 5.5 is not 5) and positive (0 only for ``zero_ok``: "derive it"); bool
    fields are true/false. ``names`` maps a field to the key the file used for it."""
    names = names or {}
    for f in fields(ModelSpec):
        if f.name not in values:
            continue
        value, key = values[f.name], names.get(f.name, f.name)
        label = key if key == f.name else f"{key} ({f.name})"
        if f.type == "int" and (type(value) is not int or value < (0 if f.name in zero_ok else 1)):
            low = "0 or more" if f.name in zero_ok else "a positive integer"
            raise ValueError(f"{path}: {label} must be {low}, got {json.dumps(value)}")
        if f.type == "bool" and type(value) is not bool:
            raise ValueError(f"{path}: {label} must be true or false, got {json.dumps(value)}")


def describe(model: ModelSpec) -> str:
    """One line: name, parameters and shape."""
    count = _count(model.num_params())
    if model.n_experts:  # what a token passes through beside what the ranks hold
        count += f" ({_count(model.active_params())} active)"
    return (f"{model.name}: {count} params, {model.n_layers} layers, "
            f"h={model.d_model}, heads={model.n_heads}/{model.n_kv_heads} kv, "
            f"ffn={model.ffn_hidden}{' (SwiGLU)' if model.gated_mlp else ''}, "
            f"vocab={model.vocab_size}{moe.describe(model)}{mla.describe(model)}")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"

