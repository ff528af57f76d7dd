"""The student: one Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM2) that reads and
writes HF folders, returns final hidden states (the fused loss applies the lm-head), and takes an
optional store of past keys/values so chunk-recurrent training can reuse it."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from distill.configs import require
from distill.errors import DistillUserError
from distill.files import atomic_dir
from kernels.twell_ffn import FFNStats, relu_gated_ffn
from student.config import StudentConfig

__all__ = ["StudentConfig", "Student", "FFNTerms", "KVStore", "ListKVStore", "prune_layers", "evenly_spaced_layers", "to_relu_gate",
           "masked_attention"]

INIT_STD = 0.02
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class KVStore(Protocol):
    """The attention of a chunk that follows earlier ones: it owns the past keys and values of each
    layer (after RoPE) and attends the chunk's queries over them and the chunk's own, causally.
    ListKVStore is the plain one; student/long_context/store.py's PagedKVStore keeps them in pages."""

    def past_length(self) -> int:
        """Positions before the chunk being run (its first position id)."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D], the chunk's k/v [B, Hkv, T, D] -> attention output [B, H, T, D]; the
        store keeps what it needs of k/v for later chunks."""


class ListKVStore:
    """The plain store: concatenates every chunk it is given (reference for paged stores)."""

    def __init__(self):
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, layer_idx):
        return self.kv.get(layer_idx)

    def past_length(self) -> int:
        return self.kv[0][0].shape[2] if 0 in self.kv else 0

    def attend(self, layer_idx, q, k, v):
        past = self.kv.get(layer_idx)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        self.kv[layer_idx] = (k, v)
        return causal_attention(q, k, v)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # Normalise in fp32 and scale after casting back, as transformers does: parity needs it.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: StudentConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], fp32, with llama3-style scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    smooth = ((old_len / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor, dtype: torch.dtype):
    """cos, sin [B, 1, T, head_dim] for position_ids [B, T]."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_attention(q, k, v):
    """q [B, H, T, D], k/v [B, Hkv, P+T, D] where the first P keys are past: query i sees keys <= P+i."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    if num_queries == num_keys:
        return masked_attention(q, k, v, None)
    past = num_keys - num_queries
    return masked_attention(q, k, v, torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(past))


def masked_attention(q, k, v, mask):
    """q [B, H, T, D], k/v [B, Hkv, S, D] (H a multiple of Hkv); mask bool, broadcast to [B, H, T, S]
    (True: attend), or None for causal with S == T. Every query must see at least one key."""
    groups = q.shape[1] // k.shape[1]
    gqa = {}
    if groups > 1 and _SDPA_HAS_GQA:
        gqa = {"enable_gqa": True}
    elif groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


class Attention(nn.Module):
    def __init__(self, config: StudentConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        d, q_width, kv_width = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(d, q_width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_width, d, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, kv_store: KVStore | None = None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
        out = causal_attention(q, k, v) if kv_store is None else kv_store.attend(self.layer_idx, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class FFNTerms(NamedTuple):
    """What a ReLU-gated MLP measured in one forward (student/sparse_ffn.py decides from it)."""

    l1: torch.Tensor  # fp32 scalar, differentiable: sum over d_ff of |h|, mean over the real tokens
    stats: FFNStats  # non-zeros per token, active neurons, overflow / fallback rows (kernels.twell_ffn)


class MLP(nn.Module):
    """Gated MLP: SwiGLU, or with hidden_act "relu" the sparse FFN h = relu(x Wg) * (x Wu), y = h Wd.

    forward(x, row_mask=None) -> (y, terms): terms is None for SwiGLU; the ReLU-gated MLP runs
    through kernels.twell_ffn and returns its FFNTerms for this call (nothing here syncs the host).
    `row_mask` (bool [N], from Student.forward's token_mask): rows that are padding get a zero
    input, so they have no non-zeros and no |h|, and l1 and nnz are means over the real rows.
    """

    def __init__(self, config: StudentConfig):
        super().__init__()
        d, h, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, h, bias=bias)
        self.up_proj = nn.Linear(d, h, bias=bias)
        self.down_proj = nn.Linear(h, d, bias=bias)
        self.hidden_act = config.hidden_act
        # kernels.twell_ffn implementation, set by the routing of student/sparse_ffn.py: "torch" (dense
        # matmuls, the default), "auto" (the Triton kernels on CUDA) or "triton"
        self.impl = "torch"

    def forward(self, x, row_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, FFNTerms | None]:
        if self.hidden_act == "silu":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), None

        weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        if torch.is_autocast_enabled(x.device.type):  # as nn.Linear would under autocast: run in its dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        x_ND = x.reshape(-1, x.shape[-1])
        mask = row_mask if row_mask is not None and row_mask.numel() == x_ND.shape[0] else None
        if mask is not None:
            x_ND = x_ND * mask[:, None].to(x_ND.dtype)
        y_ND, l1, stats = relu_gated_ffn(x_ND, *weights, impl=self.impl)
        if mask is not None:  # padding rows are all zero: the means over all rows, rescaled to the real ones
            scale = mask.numel() / mask.sum().clamp_min(1)
            l1, stats = l1 * scale, dataclasses.replace(stats, nnz=stats.nnz * scale)
        return y_ND.view(x.shape), FFNTerms(l1, stats)


class DecoderLayer(nn.Module):
    def __init__(self, config: StudentConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_store=None, row_mask=None) -> tuple[torch.Tensor, FFNTerms | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_store)
        y, terms = self.mlp(self.post_attention_layernorm(x), row_mask)
        return x + y, terms


class Student(nn.Module):
    """Llama-family decoder. Parameter names are transformers' without the `model.` prefix."""

    def __init__(self, config: StudentConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # How each decoder layer runs, when not by itself: runner(index, x, cos, sin, kv_store, row_mask)
        # -> (x, terms); student/offload/runtime.py installs one that streams the layer's weights and places its
        # activations (it then also decides recomputation: checkpoint_layers is not consulted).
        self.layer_runner = None
        # How the input embedding runs, when not by itself: runner(input_ids) -> x; student/offload/runtime.py
        # installs one that gathers the rows from host memory (student/offload/embedding.py).
        self.embed_runner = None
        self.reset_parameters()

    def reset_parameters(self):
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=INIT_STD)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[vocab_size, hidden_size]; the embedding matrix when embeddings are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids, position_ids=None, kv_store: KVStore | None = None, token_mask=None,
                return_ffn_terms: bool = False, checkpoint_layers: bool = False):
        """input_ids [B, T] int64 -> final hidden states [B, T, hidden_size] (after the last norm);
        with return_ffn_terms, (hidden states, per layer FFNTerms of a ReLU-gated student, [] for SwiGLU).

        position_ids [B, T] default to kv_store.past_length() + arange(T).
        token_mask (bool, [B, T] or [B * T]; False on padding): a ReLU-gated student's FFN terms
        leave the padding rows out; the outputs at real tokens do not change (padding follows them,
        and attention is causal). checkpoint_layers: keep only each layer's input for the backward
        and run the layer again there (activation checkpointing; needs a store whose attend may be
        called twice for the same chunk, as ListKVStore may not)."""
        if input_ids.ndim != 2:
            raise DistillUserError(f"`input_ids` must be [batch, seq], got shape {tuple(input_ids.shape)}")
        row_mask = None if token_mask is None else token_mask.reshape(-1)
        x = self.embed_tokens(input_ids) if self.embed_runner is None else self.embed_runner(input_ids)
        if position_ids is None:
            start = kv_store.past_length() if kv_store is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)
            position_ids = position_ids[None].expand(input_ids.shape[0], -1)
        cos, sin = rope_cos_sin(self.inv_freq, position_ids, x.dtype)
        terms = []
        recompute = checkpoint_layers and torch.is_grad_enabled()
        for index, layer in enumerate(self.layers):
            if self.layer_runner is not None:
                x, layer_terms = self.layer_runner(index, x, cos, sin, kv_store, row_mask)
            elif recompute:
                x, layer_terms = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, kv_store, row_mask,
                                                                   use_reentrant=False)
            else:
                x, layer_terms = layer(x, cos, sin, kv_store, row_mask)
            if layer_terms is not None:
                terms.append(layer_terms)
        hidden = self.norm(x)
        return (hidden, terms) if return_ffn_terms else hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden_size] -> logits [..., vocab_size] in hidden's dtype."""
        return F.linear(hidden, self.lm_head_weight)

    # ---- HF folders -------------------------------------------------------------------------

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under transformers' names; a tied lm-head is left out, as transformers saves it."""
        out = {}
        for name, tensor in self.state_dict().items():
            out[name if name.startswith("lm_head.") else f"model.{name}"] = tensor.contiguous()
        return out

    @classmethod
    def from_pretrained(cls, folder, dtype: torch.dtype = torch.float32, device="cpu") -> Student:
        """Load an HF folder (config.json + model.safetensors, sharded or not)."""
        folder = Path(folder)
        config = StudentConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(config)
        weights = _read_safetensors(folder)
        state = {}
        for name, tensor in weights.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some tied checkpoints store a copy of the embedding; ours is the embedding
            state[name.removeprefix("model.")] = tensor.to(device=device, dtype=dtype)
        expected = set(model.state_dict())
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise DistillUserError(
                f"weights in {folder} do not match its config.json: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        model.load_state_dict(state, assign=True)
        model.inv_freq = rope_inv_freq(config).to(device)
        return model

    def save_pretrained(self, folder) -> None:
        """Write config.json + model.safetensors to a temp folder, then rename it into place whole."""
        state = {k: v.detach().cpu() for k, v in self.hf_state_dict().items()}
        dtype = str(self.embed_tokens.weight.dtype).removeprefix("torch.")
        with atomic_dir(folder) as tmp:
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(self.config.to_hf_dict(dtype), indent=2) + "\n")

    @classmethod
    def from_teacher_pruned(cls, folder, num_layers: int, dtype: torch.dtype = torch.float32, device="cpu"):
        """The teacher in `folder` keeping `num_layers` evenly spaced layers (first and last included)."""
        teacher = cls.from_pretrained(folder, dtype=dtype, device=device)
        return prune_layers(teacher, evenly_spaced_layers(teacher.config.num_layers, num_layers))


def to_relu_gate(student: Student) -> Student:
    """Turn a SwiGLU student into the ReLU-gated (sparse) FFN in place: same weights, the gate's SiLU
    swapped for ReLU. Used as the initialisation of a sparse student; returns the same model."""
    if student.config.sparse_ffn:
        return student
    student.config = student.config.replace(hidden_act="relu")  # validates (refuses MLP biases)
    for layer in student.layers:
        layer.mlp.hidden_act = "relu"
    return student


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.exists():
        return load_file(str(single))
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(str(folder / shard)).items()}
    raise DistillUserError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def evenly_spaced_layers(num_total: int, num_keep: int) -> list[int]:
    """`num_keep` layer indices spread evenly over range(num_total), always first and last."""
    require("num_layers", num_keep, 1 <= num_keep <= num_total, f"in [1, {num_total}]")
    if num_keep == 1:
        return [0]
    return [round(i * (num_total - 1) / (num_keep - 1)) for i in range(num_keep)]


def prune_layers(student: Student, keep: list[int]) -> Student:
    """Keep only the layers `keep` (sorted, distinct) in place; returns the same model."""
    n = student.config.num_layers
    if not keep or sorted(set(keep)) != list(keep) or keep[0] < 0 or keep[-1] >= n:
        raise DistillUserError(f"`keep` must be sorted distinct layer indices in [0, {n - 1}], got {keep}")
    student.layers = nn.ModuleList(student.layers[i] for i in keep)
    for new_idx, layer in enumerate(student.layers):
        layer.self_attn.layer_idx = new_idx
    student.config = student.config.replace(num_layers=len(keep))
    return student
