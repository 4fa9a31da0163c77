"""Our forward for the Llama family (Llama, Mistral, SmolLM) and Qwen2.

RMSNorm, RoPE (with the scaling variants transformers knows), grouped-query attention over
the paged KV cache, SwiGLU MLP, optional linear biases (Qwen2's qkv bias), tied embeddings.
Token-wise ops run on all of a step's tokens at once as one `[num_tokens, hidden]` matrix
(engine.model.fused: each residual add is fused with the norm after it); only attention
looks at sequences (engine.model.attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.model.attention import AttentionMetadata, paged_attention
from pdserve.engine.model.fused import add_rms_norm, rope
from pdserve.engine.model.linear import can_pack, gated_linear, linear, pack, pack_gated
from pdserve.engine.model.weights import CheckpointReader


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that the engine and KV cache need."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float

    @classmethod
    def from_hf_config(cls, config) -> ModelShape:
        num_heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
        )


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv_weight: torch.Tensor  # q, k and v projections stacked: one matmul
    qkv_bias: torch.Tensor | None
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # gate and up projections stacked (packed for gated_linear)
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


class CausalLM:
    """A decoder-only model whose attention reads and writes a paged KV cache."""

    def __init__(self, hf_config, reader: CheckpointReader, max_model_len: int) -> None:
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config.hidden_act!r}; expected 'silu'")
        self.shape = ModelShape.from_hf_config(hf_config)
        self.dtype, self.device = reader.dtype, reader.device
        self.scale = self.shape.head_dim**-0.5
        self.embed = reader.get("model.embed_tokens.weight")
        self.layers = [_load_layer(reader, i) for i in reader.progress(self.shape.num_layers)]
        self.norm = reader.get("model.norm.weight")
        tied = getattr(hf_config, "tie_word_embeddings", False) or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.get("lm_head.weight")
        self.rope_cos, self.rope_sin = rope_tables(hf_config, max_model_len, self.dtype, self.device)
        # on the CPU: the LM head packed for oneDNN (a copy when tied to the embedding,
        # which lookups need plain); None where linear layers stay plain
        self.lm_head_packed = pack(self.lm_head) if can_pack(self.lm_head) else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        layer_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        layer_hook: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run one step over `[num_tokens]` ids; returns final hidden states `[num_tokens, H]`.

        `layer_caches[i]` is layer i's K and V caches, `[num_blocks, block_size, kv_heads,
        head_dim]` each: views of the runner's `[num_layers, 2, ...]` cache made once
        (`ModelRunner.layer_caches`), not indexed out of it on every step and layer.
        `layer_hook(layer, k, v)`, if given, sees each layer's new K/V
        (`[num_tokens, kv_heads, head_dim]`) as soon as it is computed, before the next
        layer runs: the prefill worker ships KV from here, overlapping transfer with compute.
        """
        s = self.shape
        num_tokens = input_ids.shape[0]
        hidden = F.embedding(input_ids, self.embed)
        q_size = s.num_heads * s.head_dim
        delta = None  # what the previous layer's MLP adds to the residual stream
        for index, layer in enumerate(self.layers):
            hidden, x = add_rms_norm(hidden, delta, layer.input_norm, s.rms_norm_eps)
            qkv = linear(x, layer.qkv_weight, layer.qkv_bias).view(num_tokens, -1, s.head_dim)
            q, k, v = rope(qkv, positions, self.rope_cos, self.rope_sin, s.num_heads, s.num_kv_heads)
            if layer_hook is not None:
                layer_hook(index, k, v)
            attn = paged_attention(q, k, v, *layer_caches[index], meta, self.scale)
            attn_out = linear(attn.reshape(num_tokens, q_size), layer.o_weight, layer.o_bias)
            hidden, x = add_rms_norm(hidden, attn_out, layer.post_norm, s.rms_norm_eps)
            delta = linear(gated_linear(x, layer.gate_up_weight, layer.gate_up_bias), layer.down_weight,
                           layer.down_bias)
        return add_rms_norm(hidden, delta, self.norm, s.rms_norm_eps)[1]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in fp32 for the given rows of final hidden states."""
        if self.lm_head_packed is not None:
            return linear(hidden, self.lm_head_packed).float()
        # vocab-major product: MKL runs [vocab, H] @ [H, rows] faster than the row-major
        # form when rows are few (decode batches). Made row-major here: a reduction over
        # the vocabulary of the transposed view (argmax at batch 64) ran 3x slower.
        vocab_major = torch.mm(self.lm_head, hidden.t())
        logits = torch.empty(vocab_major.shape[::-1], dtype=torch.float32, device=hidden.device)
        return logits.copy_(vocab_major.t())


def _load_layer(reader: CheckpointReader, i: int) -> DecoderLayer:
    prefix = f"model.layers.{i}."
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    return DecoderLayer(
        input_norm=reader.get(prefix + "input_layernorm.weight"),
        qkv_weight=pack(reader.stacked([attn + p + "_proj.weight" for p in "qkv"])),
        qkv_bias=reader.stacked_optional([attn + p + "_proj.bias" for p in "qkv"]),
        o_weight=pack(reader.get(attn + "o_proj.weight")),
        o_bias=reader.optional(attn + "o_proj.bias"),
        post_norm=reader.get(prefix + "post_attention_layernorm.weight"),
        gate_up_weight=pack_gated(reader.stacked([mlp + "gate_proj.weight", mlp + "up_proj.weight"])),
        gate_up_bias=reader.stacked_optional([mlp + "gate_proj.bias", mlp + "up_proj.bias"]),
        down_weight=pack(reader.get(mlp + "down_proj.weight")),
        down_bias=reader.optional(mlp + "down_proj.bias"),
    )


def rope_tables(hf_config, max_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """cos/sin tables `[max_len, head_dim]` for positions 0..max_len-1.

    Inverse frequencies come from transformers' RoPE initialisers, so every scaling variant
    a config can name (linear, llama3, yarn, longrope) matches the reference. `dynamic`
    rescales with the sequence length at run time and is not supported.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise ValueError("rope_type 'dynamic' is not supported; use a static RoPE scaling")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = ModelShape.from_hf_config(hf_config).head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    elif rope_type in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    else:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)
