"""The Hugging Face mixture-of-experts families in and out of paratrain's GPT: Mixtral,
Qwen2-MoE and Qwen3-MoE (and dense Qwen3, whose query/key norms Qwen3-MoE shares).

transformers stores one tensor per expert and projection on disk
(``...experts.3.gate_proj.weight``); paratrain stacks each projection's experts into one
(expert, out, in) tensor, so that expert parallelism shards dim 0. Import stacks the box a
rank needs; export writes them apart again.
"""

from __future__ import annotations

from pathlib import Path

from .hf_config import HFModelError

MIXTRAL, QWEN2_MOE, QWEN3_MOE, QWEN3 = ("MixtralForCausalLM", "Qwen2MoeForCausalLM",
                                        "Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
MOE_FAMILIES = {"mixtral": MIXTRAL, "qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE, "qwen3": QWEN3}
"""model_type -> architecture, for the families this module adds to the trained ones."""

_PROJ = {MIXTRAL: {"w1": "w1", "w3": "w3", "w2": "w2"},
         QWEN2_MOE: {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}}
_PROJ[QWEN3_MOE] = _PROJ[QWEN2_MOE]
_MLP = {MIXTRAL: "block_sparse_moe", QWEN2_MOE: "mlp", QWEN3_MOE: "mlp"}


def family(cfg) -> str:
    """The transformers architecture of a GPTConfig; HFModelError for a mixture of experts
    no family has (transformers could not load its export)."""
    if not cfg.n_experts:
        if cfg.qk_norm:
            return QWEN3
        return "Qwen2ForCausalLM" if cfg.qkv_bias else (
            "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM")
    arch = QWEN2_MOE if cfg.qkv_bias else (QWEN3_MOE if cfg.qk_norm else MIXTRAL)
    problems = []
    if cfg.router != "softmax" or cfg.routed_scale != 1.0 or cfg.bias_update:
        problems.append("a softmax router without scaling or selection bias")
    if arch == MIXTRAL and not cfg.norm_topk:
        problems.append("renormalised top-k weights (norm_topk)")
    if arch == MIXTRAL and (cfg.moe_every != 1 or cfg.moe_first_dense):
        problems.append("every block a mixture of experts")
    if arch != QWEN2_MOE and (cfg.shared_ffn or cfg.shared_gate):
        problems.append("no shared expert")
    if arch == QWEN2_MOE and bool(cfg.shared_ffn) != cfg.shared_gate:
        problems.append("a shared expert with its sigmoid gate")
    if problems:
        raise HFModelError(f"this mixture of experts has no transformers class: {arch} needs "
                           f"{'; '.join(problems)}")
    return arch


def block_names(cfg) -> dict[str, str]:
    """A mixture-of-experts block's non-expert tensors: paratrain name -> transformers'."""
    arch = family(cfg)
    mlp = _MLP[arch]
    out = {"mlp.router.weight": f"{mlp}.gate.weight"}
    if cfg.shared_ffn:
        out.update({f"mlp.shared.{ours}.weight": f"mlp.shared_expert.{theirs}.weight"
                    for ours, theirs in _PROJ[arch].items()})
        out["mlp.shared_gate.weight"] = "mlp.shared_expert_gate.weight"
    return out


def stacked_names(cfg) -> dict[str, tuple[str, ...]]:
    """Each stacked expert tensor -> transformers' tensor of each expert, in order."""
    arch = family(cfg)
    mlp, proj = _MLP[arch], _PROJ[arch]
    return {f"layers.{i}.mlp.experts.{ours}": tuple(
                f"model.layers.{i}.{mlp}.experts.{e}.{theirs}.weight" for e in range(cfg.n_experts))
            for i in cfg.moe_layers for ours, theirs in proj.items()}


def config_fields(cfg, arch: str) -> dict:
    """The config.json fields of ``arch`` beyond a Llama's."""
    if arch == QWEN3:
        return {"attention_bias": False}
    if not cfg.n_experts:
        return {}
    common = {"num_experts_per_tok": cfg.top_k, "router_aux_loss_coef": cfg.aux_loss_coef,
              "output_router_logits": False}
    if arch == MIXTRAL:
        return {**common, "num_local_experts": cfg.n_experts, "intermediate_size": cfg.expert_dim,
                "router_jitter_noise": 0.0}
    qwen = {**common, "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.expert_dim,
            "norm_topk_prob": cfg.norm_topk, "decoder_sparse_step": cfg.moe_every,
            "mlp_only_layers": list(range(cfg.moe_first_dense)), "use_sliding_window": False,
            "sliding_window": None}
    if arch == QWEN2_MOE:
        return {**qwen, "shared_expert_intermediate_size": cfg.shared_ffn, "qkv_bias": True}
    return {**qwen, "attention_bias": False}


def read_fields(raw: dict, path: Path) -> dict:
    """GPTConfig's mixture-of-experts (and query/key norm) fields of a config.json."""
    kind = raw.get("model_type")
    if kind not in MOE_FAMILIES:
        return {}
    directory = path.parent
    if raw.get("attention_bias") and kind in ("qwen3", "qwen3_moe"):
        raise HFModelError(f"{directory}: attention_bias=true biases the output projection, "
                           f"which paratrain's row-parallel layer does not carry")
    if kind == "qwen3":
        return {"qk_norm": True}
    if float(raw.get("router_jitter_noise") or 0):
        raise HFModelError(f"{directory}: router_jitter_noise={raw['router_jitter_noise']} "
                           f"makes routing random; paratrain routes deterministically (set it to 0)")
    top_k = _positive(raw, "num_experts_per_tok", directory)
    fields = {"top_k": top_k, "aux_loss_coef": float(raw.get("router_aux_loss_coef", 0.001))}
    if kind == "mixtral":
        return {**fields, "n_experts": _positive(raw, "num_local_experts", directory),
                "expert_ffn": _positive(raw, "intermediate_size", directory), "norm_topk": True}
    count = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
    fields.update(n_experts=_positive(raw, count, directory),  # Qwen3-MoE writes either
                  expert_ffn=_positive(raw, "moe_intermediate_size", directory),
                  norm_topk=bool(raw.get("norm_topk_prob", False)),
                  moe_every=int(raw.get("decoder_sparse_step", 1)),
                  moe_first_dense=_first_dense(raw.get("mlp_only_layers") or [], directory))
    if kind == "qwen2_moe":
        shared = int(raw.get("shared_expert_intermediate_size") or 0)
        return {**fields, "shared_ffn": shared, "shared_gate": bool(shared)}
    return {**fields, "qk_norm": True}


def _positive(raw: dict, key: str, directory: Path) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFModelError(f"{directory}: {key} must be a positive integer, got {value!r}")
    return value


def _first_dense(layers: list, directory: Path) -> int:
    """Qwen's ``mlp_only_layers`` as a count of leading dense blocks (paratrain's form)."""
    if sorted(layers) != list(range(len(layers))):
        raise HFModelError(f"{directory}: mlp_only_layers={layers}: paratrain keeps dense MLPs "
                           f"only in the first blocks (0, 1, ..., k-1)")
    return len(layers)
