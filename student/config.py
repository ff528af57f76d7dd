"""Typed config of the student decoder, read from and written back to an HF `config.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from distill.errors import DistillUserError

# model_type -> the architecture name transformers writes in `architectures`.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_MODEL_TYPE_OF_ARCH = {arch: model_type for model_type, arch in ARCHITECTURES.items()}
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# MLP gate activations: "silu" is SwiGLU (every model of these families); "relu" is the ReLU-gated
# FFN that an L1 penalty makes sparse (TwELL). transformers builds either from `hidden_act`.
HIDDEN_ACTS = ("silu", "relu")
# Keys we carry through unchanged so a saved student keeps its special tokens.
_PASSTHROUGH_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


@dataclass
class StudentConfig:
    """Shape and options of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2)."""

    model_type: str  # one of ARCHITECTURES: picks bias placement and q/k norm
    vocab_size: int  # rows of the embedding and of the lm-head
    hidden_size: int  # width d of the residual stream
    intermediate_size: int  # width d_ff of the gated MLP
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; divides num_heads (grouped-query attention)
    head_dim: int  # width of one head; HF default is hidden_size // num_heads
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: dict | None = None  # None, or llama3-style {"rope_type": "llama3", factor, ...}
    max_position_embeddings: int = 2048  # longest position the model was trained for
    tie_word_embeddings: bool = False  # lm-head shares the embedding matrix
    attention_bias: bool = False  # bias on q/k/v (and o, except Qwen2); Qwen2 always has it
    mlp_bias: bool = False  # bias on the MLP projections (Llama only)
    hidden_act: str = "silu"  # MLP gate: "silu" (SwiGLU) or "relu" (h = relu(x Wg) * (x Wu): the sparse FFN)
    extra: dict[str, Any] = field(default_factory=dict)  # special token ids, written back verbatim

    def __post_init__(self):
        if self.model_type not in ARCHITECTURES:
            raise DistillUserError(
                f"`model_type` must be one of {sorted(ARCHITECTURES)}, got {self.model_type!r}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DistillUserError(f"`{name}` must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise DistillUserError(
                f"`num_heads` must be a multiple of `num_kv_heads`, got {self.num_heads} and "
                f"{self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise DistillUserError(f"`head_dim` must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise DistillUserError(f"`rms_norm_eps` must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise DistillUserError(f"`rope_theta` must be > 0, got {self.rope_theta}")
        if self.model_type == "qwen2" and not self.attention_bias:
            raise DistillUserError("`attention_bias` must be True for qwen2 (its q/k/v always carry a bias)")
        if self.model_type in ("mistral",) and self.attention_bias:
            raise DistillUserError("`attention_bias` must be False for mistral, got True")
        if self.mlp_bias and self.model_type != "llama":
            raise DistillUserError(f"`mlp_bias` is only supported for llama, got model_type {self.model_type!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise DistillUserError(f"`hidden_act` must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.hidden_act == "relu" and self.mlp_bias:
            raise DistillUserError("`mlp_bias` must be False with hidden_act 'relu': the sparse FFN kernel has no "
                                   "bias; use a student without MLP biases")
        if self.rope_scaling is not None:
            self.rope_scaling = _check_rope_scaling(self.rope_scaling)

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def sparse_ffn(self) -> bool:
        """The MLP is ReLU-gated and runs through kernels.twell_ffn (which also reports its sparsity)."""
        return self.hidden_act == "relu"

    def replace(self, **changes) -> StudentConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, hf: dict) -> StudentConfig:
        """Read a transformers `config.json` dict; refuses anything this decoder would compute wrongly."""
        model_type = _model_type_of(hf)
        act = hf.get("hidden_act", "silu")
        if act not in HIDDEN_ACTS:
            raise DistillUserError(f"`hidden_act` must be one of {HIDDEN_ACTS} for the student decoder, got {act!r}")
        if hf.get("use_sliding_window") or (model_type == "mistral" and hf.get("sliding_window")):
            raise DistillUserError(
                f"sliding-window attention is not supported (sliding_window={hf.get('sliding_window')}); "
                "set it to null in config.json if sequences stay shorter than the window"
            )
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _read_rope(hf)
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=act,
            extra={k: hf[k] for k in _PASSTHROUGH_KEYS if k in hf},
        )

    def to_hf_dict(self, dtype: str = "float32") -> dict:
        """The `config.json` transformers needs to rebuild this model (also read by vLLM)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        hf = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,  # transformers < 5 and older vLLM read these two keys
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "dtype": dtype,
            **self.extra,
        }
        if self.model_type in ("llama", "qwen3"):
            hf["attention_bias"] = self.attention_bias
        if self.model_type == "llama":
            hf["mlp_bias"] = self.mlp_bias
        if self.model_type != "llama":
            hf["sliding_window"] = None
            hf["use_sliding_window"] = False
        return hf


def _model_type_of(hf: dict) -> str:
    archs = hf.get("architectures") or []
    if len(archs) > 1:
        raise DistillUserError(f"config.json must name one architecture, got {archs}")
    if archs:
        if archs[0] not in _MODEL_TYPE_OF_ARCH:
            raise DistillUserError(
                f"unsupported architecture {archs[0]!r}; the student supports {sorted(_MODEL_TYPE_OF_ARCH)}"
            )
        return _MODEL_TYPE_OF_ARCH[archs[0]]
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise DistillUserError(f"unsupported model_type {model_type!r}; the student supports {sorted(ARCHITECTURES)}")
    return model_type


def _read_rope(hf: dict) -> tuple[float, dict | None]:
    """RoPE base and scaling from either the transformers 5 `rope_parameters` or the older keys."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    if "rope_theta" in params and set(params) - {"rope_theta", "rope_type"}:
        scaling = params
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = (scaling or params).get("rope_type", (scaling or params).get("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {"rope_type": rope_type}


def _check_rope_scaling(scaling: dict) -> dict:
    rope_type = scaling.get("rope_type")
    if rope_type != "llama3":
        raise DistillUserError(
            f"`rope_scaling` type must be 'llama3' (or no scaling), got {rope_type!r}; "
            "other RoPE scalings are not implemented in the student"
        )
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise DistillUserError(f"llama3 `rope_scaling` is missing {missing}, got {scaling}")
    return {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_ROPE_KEYS}}
