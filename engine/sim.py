"""The simulated engine (`model: sim`): the real engine with its forward pass replaced by a
latency model, for control-plane work at a scale no machine could compute (after Dynamo's
mocker and llm-d's inference simulator).

Real: everything around the model. The scheduler, chunked prefill, the block manager,
prefix caching and its KV events, preemption, the KV connector (reservations, the layer
hook the transports ship from), the sampler with its logit adjustments, logprobs and
structured output, stop conditions, the step log and stats.

Simulated (`SimRunner`, a ModelRunner whose `forward` and `compute_logits` are replaced):

- **Time.** A step lasts what the latency model of a `pdserve profile` (engine.profile,
  `sim.profile`; default `sim_profile.json` beside this module, a copy of the committed
  benchmarks/results/profile_2cores.json) predicts for its shape (StepShape: T, Q, K, B, C),
  divided by `sim.speed`. The engine thread sleeps: nothing is computed. With a layer hook
  (a prefill worker's KV sender), layer i's K/V is handed over at (i + 1) / layers of the
  step, as a model's layers would finish.
- **Tokens.** The logits at position p are a function of p and the WINDOW tokens ending at
  p: a hash picks four preferred tokens (logits 12-14, the top one drawn about half the time
  at temperature 1) over a flat rest (0). The real sampler draws from them with the
  request's seed and output position. So a request's tokens depend on its tokens so far, its
  seed and its sampling positions alone, as with a model: the same in any batch, after
  chunking, preemption, a prefix-cache hit, disaggregation or migration.
- **KV.** The cache has the real shape, allocated without touching its pages (a model
  writes each token's KV; the simulator writes none, so only the blocks a transport writes
  into take memory), and the layer hook sees zeros of the real shape: the transports ship
  real bytes of the real size. With `sim.kv_bytes: false` the cache and the K/V are a
  stand-in of one element per token and layer (layout: 1 KV head of dimension 1): the
  transports run their whole protocol (pairing, pieces, validation, acks) on payloads of a
  few bytes a token. The number of blocks is always the real model's for the KV budget.

Weights are never loaded (engine.loader builds a SimModel from `sim.like`'s config.json):
a simulated worker is the process, the tokenizer and the bookkeeping. What transformers makes
of the checkpoint's config and tokenizer is recorded once per machine (engine.loader.sim_facts),
so a worker starts without importing transformers and loads its tokenizer at its first use
(structured output); a Ray-hosted one starts in one of its machine's start slots, as many as
its cores (cluster.actors), as concurrent imports took more CPU in all than a few at a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.engine.config import SimConfig
from pdserve.engine.model.llama import ModelShape
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.profile import Profile
from pdserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from pdserve.engine.step_log import StepShape

DEFAULT_PROFILE = Path(__file__).with_name("sim_profile.json")
WINDOW = 64  # the tokens (ending at a position) the simulated logits there depend on
PREFERRED_LOGITS = (12.0, 12.5, 13.0, 14.0)  # ascending: where two ranks pick one token, the higher wins
TokenSource = Callable[[str, int, int], Sequence[int]]  # (request id, start, end) -> its tokens [start, end)


@dataclass(frozen=True)
class SimModel:
    """What the engine needs of a model but its weights: shapes, the dtype and device of its KV."""

    shape: ModelShape
    dtype: torch.dtype
    device: torch.device


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of each element of a uint64 array (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_OFFSET_WEIGHTS = _mix(np.arange(WINDOW, dtype=np.uint64)) | np.uint64(1)  # a weight per place in the window
_RANK_SALTS = _mix(np.arange(WINDOW, WINDOW + len(PREFERRED_LOGITS), dtype=np.uint64))


def token_keys(window_before: Sequence[int], token_ids: Sequence[int], start_pos: int) -> np.ndarray:
    """A 64-bit key (uint64) per token of a chunk at positions [start_pos, ...): a hash of the
    position and the WINDOW tokens ending there. `window_before`: the (up to WINDOW - 1)
    tokens just before the chunk, all of them when the chunk starts closer to 0."""
    padding = [-1] * (WINDOW - 1 - len(window_before))  # -1 + 1 = 0: adds nothing to the hash
    sequence = np.asarray([*padding, *window_before, *token_ids], dtype=np.int64) + 1
    windows = np.lib.stride_tricks.sliding_window_view(sequence.astype(np.uint64), WINDOW)
    hashed = (windows * _OFFSET_WEIGHTS).sum(axis=1, dtype=np.uint64)
    positions = np.arange(start_pos, start_pos + len(token_ids), dtype=np.uint64)
    return _mix(hashed ^ _mix(positions))


def keyed_logits(keys: np.ndarray, vocab_size: int) -> torch.Tensor:
    """fp32 logits `[len(keys), vocab_size]`: per key, PREFERRED_LOGITS at tokens its hash
    picks, 0 elsewhere."""
    logits = torch.zeros((len(keys), vocab_size), dtype=torch.float32)
    rows = torch.arange(len(keys))
    for salt, value in zip(_RANK_SALTS, PREFERRED_LOGITS, strict=True):
        token_ids = (_mix(keys ^ salt) % np.uint64(vocab_size)).astype(np.int64)
        logits[rows, torch.from_numpy(token_ids)] = value
    return logits


class SimRunner(ModelRunner):
    """A ModelRunner whose forward sleeps the profile's step time and whose "hidden states"
    are per-token keys (`token_keys`), turned into logits by `keyed_logits`. `tokens(request_id,
    start, end)` gives a scheduled request's tokens (the engine's own record of them)."""

    def __init__(self, model: SimModel, num_blocks: int, block_size: int, sim: SimConfig,
                 tokens: TokenSource) -> None:
        self.sim = sim
        super().__init__(model, num_blocks, block_size)
        self.profile = Profile.load(sim.profile or DEFAULT_PROFILE)
        self._tokens = tokens
        self._step_started = self._step_s = 0.0
        self._zeros = torch.zeros(0)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Of the real shape, its pages untouched (see the module docstring), or the stand-in."""
        s = self.model.shape
        heads, dim = (s.num_kv_heads, s.head_dim) if self.sim.kv_bytes else (1, 1)
        shape = (s.num_layers, 2, num_blocks, self.block_size, heads, dim)
        make = torch.empty if self.sim.kv_bytes else torch.zeros
        return make(shape, dtype=self.model.dtype, device=self.device)

    def step_seconds(self, chunks: list[ScheduledChunk]) -> float:
        """The time a step of `chunks` takes: the profile's prediction for its shape / speed."""
        shape = StepShape.of(chunks)
        predicted = self.profile.step_s(shape.prefill_tokens, shape.prefill_squared, shape.decode_batch,
                                        shape.decode_context, shape.prefill_cached)
        return predicted / self.sim.speed

    def execute(self, output: SchedulerOutput):
        """The real step's results on simulated logits, returned when the step's time is up.
        Torch runs on one thread meanwhile: the step computes nothing worth threads, and
        waking torch's pool for its `[rows, vocab]` ops took 4 ms a step on a busy 2-core
        machine (0.15 ms on one thread), more than a fast simulated decode step lasts."""
        self._step_started = time.monotonic()
        self._step_s = self.step_seconds(output.chunks) if not output.is_empty else 0.0
        with _one_torch_thread():
            result = super().execute(output)
        _sleep_until(self._step_started + self._step_s)
        return result

    def forward(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Each scheduled token's key (int64 bits of `token_keys`), the layer hook fed zero K/V
        of the cache's shape, layer i at (i + 1) / layers of the step."""
        if self.kv_hook is not None:
            layers = self.kv_cache.shape[0]
            hook = self._layer_hook(chunks)
            k = v = self._zero_kv(sum(len(c.token_ids) for c in chunks))
            for layer in range(layers):
                _sleep_until(self._step_started + self._step_s * (layer + 1) / layers)
                hook(layer, k, v)
        keys = [token_keys(self._tokens(c.request_id, max(0, c.start_pos - WINDOW + 1), c.start_pos),
                           c.token_ids, c.start_pos) for c in chunks]
        return torch.from_numpy(np.concatenate(keys).view(np.int64))

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return keyed_logits(rows.numpy().view(np.uint64), self.model.shape.vocab_size)

    def _zero_kv(self, num_tokens: int) -> torch.Tensor:
        """`[num_tokens, kv_heads, head_dim]` zeros of the cache's dtype (one buffer, grown as needed)."""
        if self._zeros.shape[0] < num_tokens:
            self._zeros = torch.zeros((num_tokens, *self.kv_cache.shape[4:]), dtype=self.kv_cache.dtype,
                                      device=self.kv_cache.device)
        return self._zeros[:num_tokens]


@contextlib.contextmanager
def _one_torch_thread():
    """Torch's intra-op threads at 1 meanwhile, where torch lets them change (OpenMP builds;
    the native thread pool refuses once it has run)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
    except RuntimeError:
        threads = None
    try:
        yield
    finally:
        if threads is not None:
            torch.set_num_threads(threads)


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
