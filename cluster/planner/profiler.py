"""`pdserve profile`: measure an engine's step times on this hardware and fit a Profile.

Prefill: single steps of T prompt tokens (one chunk, and several requests' chunks).
Decode: steady decode steps at batch B over contexts C (DECODE_SHAPES). Mixed: a step carrying a prompt
chunk of T tokens and B running decodes at once (what a colocated engine, or a decode
worker prefilling locally, runs; the TPOT a prompt inflicts on every running request).
Cached: prefill and mixed steps whose new tokens follow a prefix the prefix cache holds (a
chat turn over its history, a long prompt's later chunk): their attention over that KV is
the models' K term (engine.profile), fitted on these after the rest.
KV transfer: the torch transport moving one 2048-token prompt's KV between two ends of a
real gloo/NCCL pair (in one process, two threads). Every figure is a median of repeats.
Every timed prompt's new tokens are new to the engine: a prefix-cache hit would time a
lookup, not a prefill.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.profile import Profile, fit_cached_attention, fit_colocated, fit_decode, fit_prefill
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_log import StepShape

CACHED_PREFIXES = (512, 1536)  # cached prefix lengths the K term is profiled over
# (rows, per-row context) of the decode steps profiled: serving's shapes, 1-64 rows at
# 64-2,048 tokens a row (online's rows carry 400-500, chat's 1,000-1,400; a grid that
# stopped at 512 a row had serving's long rows run up to 1.22x its model), at most
# 16,384 tokens in all (the prefill that reaches the batch stays short)
DECODE_SHAPES = ((1, 64), (1, 512), (1, 1024), (1, 2048), (2, 512), (4, 64), (4, 512), (4, 1024), (4, 2048),
                 (8, 128), (8, 512), (8, 1024), (16, 64), (16, 256), (16, 512), (16, 1024), (32, 128), (32, 512),
                 (64, 64))


def profile_engine(config: EngineConfig, repeats: int = 3, progress=print) -> Profile:
    engine = LLMEngine(config)
    budget = config.max_num_batched_tokens
    max_len = engine.max_model_len
    prefill_samples = []
    sizes = [t for t in (32, 128, 256, 512, 1024, 2048, 4096) if t <= budget and t < max_len]
    for tokens in sizes:
        for pieces in (1, 4):
            if tokens // pieces < 8:
                continue
            seconds = time_prefill_step(engine, [tokens // pieces] * pieces, repeats)
            squared = pieces * (tokens // pieces) ** 2
            prefill_samples.append((tokens // pieces * pieces, squared, seconds))
            progress(f"prefill {pieces} x {tokens // pieces} tokens: {seconds * 1000:.1f} ms")
    decode_samples = []
    for batch, context in DECODE_SHAPES:
        if batch > config.max_num_seqs or context + 16 >= max_len:
            continue
        seconds = time_decode_step(engine, batch, context, repeats)
        decode_samples.append((batch, batch * context, seconds))
        progress(f"decode batch {batch} x {context} context: {seconds * 1000:.1f} ms")
    mixed_samples = []
    for batch in (4, 16, 64):
        for tokens in (128, 512, 1536):
            if batch > config.max_num_seqs or tokens + batch > budget or tokens >= max_len or 128 + 16 >= max_len:
                continue
            shape, seconds = _mixed_step(engine, batch, 128, tokens, repeats)
            mixed_samples.append((shape.prefill_tokens, shape.prefill_squared, shape.decode_batch,
                                  shape.decode_context, seconds))
            progress(f"mixed {tokens} prompt tokens + decode batch {batch} x 128 context: {seconds * 1000:.1f} ms")
    cached_samples = []
    for cached in CACHED_PREFIXES:
        for tokens, batch in ((64, 0), (256, 0), (1024, 0), (64, 4), (256, 16)):
            if cached + tokens >= max_len or tokens + batch > budget or batch > config.max_num_seqs:
                continue
            shape, seconds = time_cached_step(engine, tokens, batch, cached, repeats)
            cached_samples.append((shape.prefill_tokens, shape.prefill_squared, shape.decode_batch,
                                   shape.decode_context, shape.prefill_cached, seconds))
            progress(f"{tokens} prompt tokens over {cached} cached" + (f" + decode batch {batch}" if batch else "")
                     + f": {seconds * 1000:.1f} ms")
    bandwidth = measure_kv_bandwidth(engine)
    progress(f"KV transfer: {bandwidth / 1e9:.2f} GB/s")
    from pdserve.kv_transfer.layout import KVLayout

    layout = KVLayout.of_cache(engine.runner.kv_cache)
    kv_bytes_per_token = layout.token_bytes * layout.num_layers
    fresh = Profile(
        model=config.model, prefill_coeffs=fit_prefill(prefill_samples), decode_coeffs=fit_decode(decode_samples),
        colocated_coeffs=fit_colocated(prefill_samples, decode_samples, mixed_samples) if mixed_samples else None,
        kv_bytes_per_token=kv_bytes_per_token, kv_bandwidth_bytes_per_s=bandwidth,
        max_num_batched_tokens=budget, max_num_seqs=config.max_num_seqs,
        kv_capacity_tokens=engine.block_manager.num_blocks * config.block_size,
        samples={"prefill": prefill_samples, "decode": decode_samples, "mixed": mixed_samples,
                 "cached": cached_samples, "threads": torch.get_num_threads()},
    )
    return with_cached_attention(fresh, cached_samples)


def with_cached_attention(profile: Profile, samples: list[tuple]) -> Profile:
    """`profile` (fitted on fresh prompts) with its K terms fitted on `samples` (T, Q, B, C, K,
    seconds) of steps over a cached prefix: p3 on the prefill-only ones, c7 on the mixed ones
    (fit_cached_attention: what the rest of the model leaves over, per unit of K)."""
    from dataclasses import replace

    def term(rows: list[tuple], model) -> float:
        return fit_cached_attention([(k, s, model(t, q, b, c)) for t, q, b, c, k, s in rows])

    prefill = [r for r in samples if not r[2]]
    mixed = [r for r in samples if r[2]]
    if prefill:
        p3 = term(prefill, lambda t, q, b, c: profile.prefill_step_s(t, q))
        profile = replace(profile, prefill_coeffs=(*profile.prefill_coeffs[:3], p3))
    if mixed and profile.colocated_coeffs is not None:
        c7 = term(mixed, profile.colocated_step_s)
        profile = replace(profile, colocated_coeffs=(*(*profile.colocated_coeffs, 0.0, 0.0)[:7], c7))
    return profile


_SEEDS = itertools.count(1000)


def prompt_ids(n: int, seed: int | None = None) -> list[int]:
    """`n` random token ids; a fresh prompt (no shared prefix with any other) unless `seed`."""
    generator = torch.Generator().manual_seed(next(_SEEDS) if seed is None else seed)
    return torch.randint(3, 1000, (n,), generator=generator).tolist()


def time_prefill_step(engine: LLMEngine, lengths: list[int], repeats: int) -> float:
    """Median seconds of one step prefilling fresh prompts of `lengths` together (a warm-up
    round first, then `repeats` timed)."""
    times = []
    for r in range(repeats + 1):
        for i, n in enumerate(lengths):
            engine.add_request(f"pf-{r}-{i}", prompt_ids(n), SamplingParams(max_tokens=1, temperature=0))
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        while engine.has_unfinished_requests():
            engine.step()
        if r:  # the first round warms up
            times.append(elapsed)
    return statistics.median(times)


def start_decodes(engine: LLMEngine, batch: int, context: int, steps: int, tag: str) -> None:
    """`batch` running requests of `context` prompt tokens, prefilled, with at least `steps`
    decode steps ahead of them (the first prefilled decode while the rest prefill)."""
    prefill_steps = -(-batch * context // engine.config.max_num_batched_tokens)
    params = SamplingParams(max_tokens=steps + prefill_steps, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{context}-{i}", prompt_ids(context, i), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()


def time_decode_step(engine: LLMEngine, batch: int, context: int, repeats: int) -> float:
    """Median seconds of a decode step of `batch` running requests of `context` prompt tokens
    each, over about `repeats` + 2 steps (the last, emptier one left out)."""
    start_decodes(engine, batch, context, repeats + 3, "dc")
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[:-1] or times)


def time_new_prompt_step(engine: LLMEngine, make_prompt, tag: str, repeats: int) -> tuple[StepShape, float]:
    """Median seconds of the step that computes a new prompt (`make_prompt()`, called once a
    repeat) beside whatever the engine is running, over `repeats` (one more first, left out:
    a warm-up); with the step's shape as the latency model counts it."""
    times, shape = [], StepShape()
    for r in range(repeats + 1):
        engine.add_request(f"{tag}-{r}", make_prompt(), SamplingParams(max_tokens=1))
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        shape = engine.last_step_shape
        if r:
            times.append(elapsed)
    return shape, statistics.median(times)


def _mixed_step(engine: LLMEngine, batch: int, context: int, tokens: int, repeats: int) -> tuple[StepShape, float]:
    """Median seconds of a step computing a fresh `tokens`-token prompt alongside `batch`
    running decodes; with the step's shape."""
    start_decodes(engine, batch, context, repeats + 3, "mx")
    shape, seconds = time_new_prompt_step(engine, lambda: prompt_ids(tokens), f"mx-prompt-{batch}-{tokens}", repeats)
    while engine.has_unfinished_requests():
        engine.step()
    return shape, seconds


def time_cached_step(engine: LLMEngine, tokens: int, batch: int, cached: int, repeats: int,
                     decode_context: int = 128) -> tuple[StepShape, float]:
    """Median seconds of a step computing `tokens` new prompt tokens after `cached` tokens the
    prefix cache holds (0: a fresh prompt), beside `batch` running decodes of
    `decode_context` tokens (0: a prefill-only step); with the step's shape."""
    prefix = prompt_ids(cached, 77) if cached else []
    if cached:  # put the prefix in the cache: a request over it, run to the end
        engine.add_request(f"prefix-{cached}-{tokens}-{batch}", prefix, SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    if batch:
        start_decodes(engine, batch, decode_context, repeats + 3, f"cached{cached}-{tokens}")
    shape, seconds = time_new_prompt_step(engine, lambda: prefix + prompt_ids(tokens),
                                          f"cached-{tokens}-{batch}-{cached}", repeats)
    while engine.has_unfinished_requests():
        engine.step()
    return shape, seconds


def measure_kv_bandwidth(engine: LLMEngine, tokens: int = 2048) -> float:
    """Bytes/s of the torch transport over a loopback pair (both ends in this process)."""
    from pdserve.kv_transfer.layout import KVLayout
    from pdserve.kv_transfer.reservations import ReservationTable
    from pdserve.kv_transfer.torch_transport import TorchTransport

    cache = engine.runner.kv_cache
    layout = KVLayout.of_cache(cache)
    blocks = -(-tokens // layout.block_size)
    target = torch.zeros(layout.num_layers, 2, blocks, layout.block_size, layout.num_kv_heads, layout.head_dim,
                         dtype=cache.dtype, device=cache.device)
    table = ReservationTable(layout, target)
    receiver = TorchTransport("profile-d", layout, cache.device, max_piece_tokens=tokens)
    sender_side = TorchTransport("profile-p", layout, cache.device, max_piece_tokens=tokens)
    receiver.listen(table)
    endpoint = receiver.accept("profile-p")
    holder = {}
    joiner = threading.Thread(target=lambda: holder.update(sender=sender_side.connect(endpoint)))
    joiner.start()
    joiner.join(60)
    sender = holder["sender"]
    k = torch.randn(tokens, layout.num_kv_heads, layout.head_dim).to(cache)
    times = []
    for _ in range(3):
        res = table.register("profile", list(range(blocks)), tokens, peer="profile-p")
        start = time.perf_counter()
        for layer in range(layout.num_layers):
            sender.send(res.transfer_id, layer, 0, k, k)
        res.done.wait(60)
        times.append(time.perf_counter() - start)
        table.release(res.transfer_id)
    sender.close()
    receiver.wait_closed("profile-p", timeout_s=120)  # a loaded machine: the pair's threads must end before exit
    receiver.close()
    sender_side.close()
    return tokens * layout.token_bytes * layout.num_layers / statistics.median(times)
