"""Turns a SchedulerOutput into tensors, runs the model, samples.

The runner owns the KV cache tensor `[num_layers, 2, num_blocks, block_size, kv_heads,
head_dim]`; block ids from the block manager index its third axis.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.kv_connector import slot_mapping
from pdserve.engine.model.attention import AttentionMetadata, PrefillSpan
from pdserve.engine.model.llama import CausalLM
from pdserve.engine.outputs import TokenLogprob
from pdserve.engine.sampler import sample_with_logprobs, token_logprobs
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput

KVHook = Callable[[str, int, int, torch.Tensor, torch.Tensor], None]
_SCORE_ROWS = 256  # prompt rows scored at once (prompt logprobs)


@dataclass
class StepResult:
    """One step's results: {request_id: sampled token} for sampling chunks, {request_id:
    its TokenLogprob} where the request asked for logprobs, and {request_id: (position of
    the first, TokenLogprobs of consecutive prompt tokens)} where it asked for prompt logprobs."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class ModelRunner:
    """`kv_hook(request_id, layer, token_start, k, v)`, when set, receives every scheduled
    chunk's new K/V per layer as soon as that layer is computed (see CausalLM.forward).
    `forward` and `compute_logits` are the model's part of a step; the simulated engine
    (engine.sim.SimRunner) replaces only them."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int) -> None:
        self.kv_hook: KVHook | None = None
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.kv_cache = self.allocate_kv_cache(num_blocks)
        # each layer's K and V caches, as the model's forward takes them (views, made once)
        self.layer_caches = [(layer[0], layer[1]) for layer in self.kv_cache]

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """The paged cache `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`, zeroed."""
        s = self.model.shape
        return torch.zeros((s.num_layers, 2, num_blocks, self.block_size, s.num_kv_heads, s.head_dim),
                           dtype=self.model.dtype, device=self.device)

    def execute(self, output: SchedulerOutput) -> StepResult:
        """Compute the scheduled tokens, sample where chunks ask, and score prompt tokens
        for chunks that carry `prompt_targets`."""
        result = StepResult()
        if output.is_empty:
            return result
        hidden = self.forward(output.chunks)
        starts = np.cumsum([0] + [len(c.token_ids) for c in output.chunks])
        for chunk, start in zip(output.chunks, starts, strict=False):
            if chunk.prompt_targets:
                result.prompt_logprobs[chunk.request_id] = (
                    chunk.start_pos + 1, self._score(hidden[start:start + len(chunk.prompt_targets)],
                                                     chunk.prompt_targets, chunk.sampling_params.prompt_logprobs))
        sampling = [(i, c) for i, c in enumerate(output.chunks) if c.sample]
        if not sampling:
            return result
        rows = torch.as_tensor(starts[[i + 1 for i, _ in sampling]] - 1, device=hidden.device)
        logits = self.compute_logits(hidden[rows])
        chunks = [c for _, c in sampling]
        tokens, logprobs = sample_with_logprobs(logits, [c.sampling_params for c in chunks], [c.seed for c in chunks],
                                                [c.output_index for c in chunks], [c.history for c in chunks],
                                                [c.guide for c in chunks])
        result.sampled = {c.request_id: t for c, t in zip(chunks, tokens, strict=True)}
        result.logprobs = {c.request_id: lp for c, lp in zip(chunks, logprobs, strict=True) if lp is not None}
        return result

    def _score(self, hidden: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
        """Each row's logprob of its target token and its k most likely tokens (the model's
        log-softmax), a slice of rows at a time to bound the `[rows, vocab]` logits."""
        scored = []
        for begin in range(0, len(targets), _SCORE_ROWS):
            rows = targets[begin:begin + _SCORE_ROWS]
            scored += token_logprobs(self.compute_logits(hidden[begin:begin + len(rows)]), rows, [k] * len(rows))
        return scored

    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """The step's forward pass: one row per scheduled token, in chunk order (the final
        hidden states), the layer hook fed as each layer is computed."""
        input_ids, positions, meta = self.prepare(chunks)
        hook = self._layer_hook(chunks) if self.kv_hook is not None else None
        return self.model.forward(input_ids, positions, meta, self.layer_caches, hook)

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[len(rows), vocab]` of rows of `forward`'s result."""
        return self.model.compute_logits(rows)

    def _layer_hook(self, chunks: list[ScheduledChunk]):
        spans, row = [], 0
        for chunk in chunks:
            spans.append((chunk.request_id, chunk.start_pos, row, row + len(chunk.token_ids)))
            row += len(chunk.token_ids)

        def hook(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            for request_id, start_pos, begin, end in spans:
                self.kv_hook(request_id, layer, start_pos, k[begin:end], v[begin:end])

        return hook

    def prepare(self, chunks: list[ScheduledChunk]):
        """Flat input ids and positions, and the attention metadata, for one step."""
        bs = self.block_size
        ids, pos, slots = [], [], []
        decode_index, decode_tables, decode_lens, prefills = [], [], [], []
        for chunk in chunks:
            n, start = len(chunk.token_ids), chunk.start_pos
            table = np.asarray(chunk.block_table, dtype=np.int64)
            if n == 1:
                decode_index.append(len(ids))
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillSpan(len(ids), n, start, self._tensor(table)))
            ids.extend(chunk.token_ids)
            pos.append(np.arange(start, start + n, dtype=np.int64))
            slots.append(slot_mapping(table, start, start + n, bs))
        max_blocks = max((len(t) for t in decode_tables), default=0)
        padded = np.zeros((len(decode_tables), max_blocks), dtype=np.int64)
        for row, table in enumerate(decode_tables):
            padded[row, : len(table)] = table
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)),
            decode_token_index=self._tensor(np.asarray(decode_index, dtype=np.int64)),
            decode_block_tables=self._tensor(padded),
            decode_ctx_lens=self._tensor(np.asarray(decode_lens, dtype=np.int64)),
            prefills=prefills,
        )
        input_ids = self._tensor(np.asarray(ids, dtype=np.int64))
        return input_ids, self._tensor(np.concatenate(pos)), meta

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)
