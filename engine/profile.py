"""Latency models of one engine instance, fitted from profiled step times.

prefill step (T batched prompt tokens, Q = sum over chunks of length x context reached:
attention; K = the part of Q over context computed before the chunk, a cached prefix or
the prompt's earlier chunks):
    t = p0 + p1 * T + p2 * Q + p3 * K
    p3: attention over KV already in the paged cache costs more than within the chunk
    (measured, bf16, 1 core: chunks of 64-128 tokens over a 1,024-1,600-token cached prefix
    took 1.43-1.71x a model fitted on fresh prompts alone, benchmarks/profile_coverage.py).
    Profiles from before this term carry three coefficients: p3 = 0.
decode step (B running requests, C their total context tokens):
    t = d0 + d1 * B + d2 * C + d3 * B^2
    d3: fitted with d0..d2 to minimise relative error over 1-64 rows at per-row contexts of
    64-2,048 tokens (benchmarks/engine_shapes.py: linearly, 6.4-6.9% rms there, the long
    rows under-predicted and 16-32 short ones over-predicted; with B^2, 2.4-2.5%). Profiles
    from before this term carry three coefficients: d3 = 0.
a mixed step (both at once: a colocated engine, or a decode worker prefilling locally),
    fitted on profiled mixed steps as well as pure ones:
    t = c0 + c1 * T + c2 * Q + c3 * B + c4 * C + c5 * T^2 + c6 * [T > 0 and B > 0] + c7 * K
    c5: a step's cost grows faster than its tokens once its activations outgrow the caches
    (measured, bf16 on 2 cores: 4 prompts of 512 took 1.43 s, 1 of 1024 0.77 s; the Q term
    alone put the first at 1.06 s); c6: the fixed extra of carrying both kinds of rows (the
    mixed attention path, the linear layers' kernel choice past 16 rows: 16 decodes took
    42 ms, with a 16-token prompt beside them 60 ms); c7: as p3. Profiles from before these
    terms carry five or seven coefficients: the missing ones are 0.
    (profiles without mixed samples: one weight pass doing both, p0 + p1 T + p2 Q + p3 K +
    d1 B + d2 C)
    serving calibration may add a size exponent a: M * (M / reference) ** -a (a colocated
    engine's small mixed steps slowed more than its large ones; Profile.colocated_step_s)
a decode step while prefill instances sharing its host compute takes longer by
    rate * (e0 + e1 * B + e2 * C), rate being the prompt tokens per second those prefill
    instances compute at (averaged over them, 0 while idle): co-tenancy on one host's caches
    and memory bandwidth. Measured on 2 cores, a core each: decode steps ran 18-20% slower
    while the prefill worker beside them prefilled short prompts (many steps a second, at a
    high token rate) and 8-10% slower while it prefilled 2,000-token ones (attention-bound,
    a lower token rate); by the share of time it computed, one term over-predicted the
    second by 5.5-8%, by its token rate by 2.6-4%. 0 unless serving calibration measured it
    (cluster.planner.calibrate), and 0 where the pools do not share hosts.
KV transfer of n tokens: n * kv_bytes_per_token / kv_bandwidth_bytes_per_s
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Profile:
    model: str
    prefill_coeffs: tuple[float, ...]  # p0 [s], p1 [s/token], p2 [s/token^2], p3 [s/token^2] (optional)
    decode_coeffs: tuple[float, ...]  # d0 [s], d1 [s/request], d2 [s/context token], d3 [s/request^2] (optional)
    kv_bytes_per_token: int
    kv_bandwidth_bytes_per_s: float
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 1 << 20
    colocated_coeffs: tuple[float, ...] | None = None  # c0..c7 (None: from the two above)
    # serving's fixed cost of a first token beyond the engine steps that make it: HTTP, the
    # router, the RPCs to the workers, streaming it back (0 for the engine alone; serving
    # calibration measures it, cluster.planner.calibrate.with_first_token_overhead)
    first_token_overhead_s: float = 0.0
    # e0, e1, e2 [s per prefill token/s; per request, per context token]: a decode step's
    # extra per prompt token a second that the prefill instances beside it compute (see the
    # module's docstring)
    decode_cotenancy_coeffs: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # a mixed step's extra, as a share of the step, per prompt token a second that the
    # prefill instances beside it compute (the same co-tenancy, on a decode worker's local
    # prefills)
    mixed_cotenancy: float = 0.0
    # serving's slowdown of a mixed step falls with the step's size: the mixed model M is
    # taken as M * (M / mixed_reference_s) ** -mixed_size_exponent (see colocated_step_s;
    # 0: a plain factor, as profiled engine-alone steps need; serving calibration measures it)
    mixed_size_exponent: float = 0.0
    mixed_reference_s: float = 1.0
    samples: dict = field(default_factory=dict, compare=False)  # raw measurements, for the record

    def __post_init__(self) -> None:
        for name, sizes in (("prefill_coeffs", (3, 4)), ("decode_coeffs", (3, 4)), ("colocated_coeffs", (5, 7, 8)),
                            ("decode_cotenancy_coeffs", (3, 4))):
            coeffs = getattr(self, name)
            if coeffs is None and name == "colocated_coeffs":
                continue
            if len(coeffs) not in sizes or not all(isinstance(c, int | float) and math.isfinite(c) and c >= 0
                                                   for c in coeffs):
                count = ", ".join(map(str, sizes[:-1])) + " or " + str(sizes[-1]) if len(sizes) > 1 else str(sizes[0])
                raise ValueError(f"profile {name} must be {count} finite non-negative numbers, got {coeffs!r}")
        if not (isinstance(self.mixed_cotenancy, int | float) and math.isfinite(self.mixed_cotenancy)
                and self.mixed_cotenancy >= 0):
            raise ValueError(f"profile mixed_cotenancy must be a finite number >= 0, got {self.mixed_cotenancy!r}")
        exponent = self.mixed_size_exponent
        if not (isinstance(exponent, int | float) and 0 <= exponent < 1):
            raise ValueError(f"profile mixed_size_exponent must be a number in [0, 1), got {exponent!r}")
        if not (isinstance(self.mixed_reference_s, int | float) and math.isfinite(self.mixed_reference_s)
                and self.mixed_reference_s > 0):
            raise ValueError(f"profile mixed_reference_s must be a finite number > 0, got {self.mixed_reference_s!r}")
        overhead = self.first_token_overhead_s
        if not (isinstance(overhead, int | float) and math.isfinite(overhead) and overhead >= 0):
            raise ValueError(f"profile first_token_overhead_s must be a finite number >= 0, got {overhead!r}")
        if not self.kv_bandwidth_bytes_per_s > 0 or self.kv_bytes_per_token < 0:
            raise ValueError("profile kv_bandwidth_bytes_per_s must be > 0 and kv_bytes_per_token >= 0")
        for name in ("max_num_batched_tokens", "max_num_seqs", "kv_capacity_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"profile {name} must be a positive integer, got {getattr(self, name)!r}")

    def prefill_step_s(self, tokens: int, squared: float, cached: float = 0) -> float:
        """A step of `tokens` prompt tokens whose attention is `squared` (Q), `cached` (K) of
        it over KV computed before the step."""
        p0, p1, p2, p3 = (*self.prefill_coeffs, 0.0)[:4]
        return p0 + p1 * tokens + p2 * squared + p3 * cached

    def decode_step_s(self, batch: int, context: int, prefill_rate: float = 0.0) -> float:
        """A decode step of `batch` requests attending `context` tokens in all, while the
        prefill instances sharing its host compute `prefill_rate` prompt tokens a second."""
        d0, d1, d2, d3 = (*self.decode_coeffs, 0.0)[:4]
        step = d0 + d1 * batch + d2 * context + d3 * batch * batch
        if prefill_rate:
            e0, e1, e2, e3 = (*self.decode_cotenancy_coeffs, 0.0)[:4]
            step += prefill_rate * (e0 + e1 * batch + e2 * context + e3 * batch * batch)
        return step

    def colocated_step_s(self, tokens: int, squared: float, batch: int, context: int, cached: float = 0,
                         prefill_rate: float = 0.0) -> float:
        """A step of prompt chunks (`tokens`, `squared`, `cached`: T, Q, K) beside `batch`
        decodes of `context` tokens in all, while prefill instances sharing its host compute
        `prefill_rate` prompt tokens a second (a decode worker's local prefill).

        With a mixed_size_exponent a, the model M is taken as M * (M / mixed_reference_s) ** -a:
        serving slows a small mixed step more than a large one: a colocated engine of two
        threads on 2 cores took 1.8-1.9x the engine-alone model at 0.3-0.6 s and 1.3-1.4x at
        2.2-3.5 s, and a fitted 0.11-0.14; a decode worker's mixed steps (one torch thread)
        fit about 0 (measurements: benchmarks/README.md, "How the planner's model got where
        it is")."""
        if self.colocated_coeffs is not None:
            c0, c1, c2, c3, c4, c5, c6, c7 = (*self.colocated_coeffs, 0.0, 0.0, 0.0)[:8]
            both = 1.0 if tokens and batch else 0.0
            step = (c0 + c1 * tokens + c2 * squared + c3 * batch + c4 * context + c5 * tokens * tokens + c6 * both
                    + c7 * cached)
        else:
            step = (max(self.prefill_coeffs[0], self.decode_coeffs[0]) - self.prefill_coeffs[0]
                    + self.prefill_step_s(tokens, squared, cached) + self.decode_step_s(batch, context)
                    - self.decode_coeffs[0])
        if self.mixed_size_exponent and step > 0:
            step *= (step / self.mixed_reference_s) ** -self.mixed_size_exponent
        return step * (1.0 + self.mixed_cotenancy * prefill_rate)

    def step_s(self, tokens: int, squared: float, batch: int, context: int, cached: float = 0,
               prefill_rate: float = 0.0) -> float:
        """Any step, by its kind (`step_kind`): the prefill, decode or mixed-step model; a
        decode or mixed one beside prefill instances computing `prefill_rate` tokens a second."""
        kind = step_kind(tokens, batch)
        if kind == "mixed":
            return self.colocated_step_s(tokens, squared, batch, context, cached, prefill_rate)
        if kind == "prefill":
            return self.prefill_step_s(tokens, squared, cached)
        return self.decode_step_s(batch, context, prefill_rate)

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.kv_bandwidth_bytes_per_s

    def scaled(self, prefill: float = 1.0, decode: float = 1.0, mixed: float | None = None) -> Profile:
        """The same profile with step times multiplied: prefill steps by `prefill`, decode
        steps by `decode`, mixed steps by `mixed` (default: their prefill terms by `prefill`,
        their decode terms by `decode`, and mixed_reference_s, so that a size exponent keeps
        its meaning, by the larger of the two). Autoscaler corrections; serving calibration."""
        from dataclasses import replace

        colocated = self.colocated_coeffs
        reference = self.mixed_reference_s * (mixed if mixed is not None else max(prefill, decode))
        if mixed is not None:
            p0, p1, p2, p3 = (*self.prefill_coeffs, 0.0)[:4]
            _, d1, d2 = self.decode_coeffs[:3]  # (the mixed-step model has no B^2 term)
            base = colocated or (max(p0, self.decode_coeffs[0]), p1, p2, d1, d2, 0.0, 0.0, p3)
            colocated = tuple(c * mixed for c in base)
        elif colocated is not None:  # prefill terms by the prefill factor, decode terms by the decode one
            both = max(prefill, decode)
            colocated = (colocated[0] * both, colocated[1] * prefill, colocated[2] * prefill,
                         colocated[3] * decode, colocated[4] * decode,
                         *(c * f for c, f in zip(colocated[5:], (prefill, both, prefill), strict=False)))
        return replace(self, prefill_coeffs=tuple(c * prefill for c in self.prefill_coeffs),
                       decode_coeffs=tuple(c * decode for c in self.decode_coeffs), colocated_coeffs=colocated,
                       decode_cotenancy_coeffs=tuple(c * decode for c in self.decode_cotenancy_coeffs),
                       mixed_reference_s=reference)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"profile {path} not found") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"profile {path} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"profile {path}: expected a JSON object")
        known = set(cls.__dataclass_fields__)
        missing = {"model", "prefill_coeffs", "decode_coeffs", "kv_bytes_per_token",
                   "kv_bandwidth_bytes_per_s"} - set(data)
        if missing or set(data) - known:
            raise ValueError(f"profile {path}: missing {sorted(missing)}, unknown {sorted(set(data) - known)}")
        data["prefill_coeffs"] = tuple(data["prefill_coeffs"])
        data["decode_coeffs"] = tuple(data["decode_coeffs"])
        if "decode_cotenancy_coeffs" in data:
            data["decode_cotenancy_coeffs"] = tuple(data["decode_cotenancy_coeffs"])
        if data.get("colocated_coeffs") is not None:
            data["colocated_coeffs"] = tuple(data["colocated_coeffs"])
        try:
            return cls(**data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"profile {path}: {exc}") from None


def step_kind(tokens: int, batch: int) -> str:
    """"mixed" (prompt tokens beside decodes), "prefill" (prompt tokens only) or "decode"."""
    if tokens and batch:
        return "mixed"
    return "prefill" if tokens else "decode"


def prefill_seconds(profile: Profile, tokens: int, batch: int = 0, context: int = 0) -> float:
    """Predicted time to prefill `tokens` prompt tokens, chunked under the token budget; with
    `batch` running requests of `context` tokens in all, each step also carries their decode.
    A chunk after the first attends over the ones before it as well (Q and K)."""
    budget, seconds = profile.max_num_batched_tokens, 0.0
    for start in range(0, tokens, budget):
        chunk = min(budget, tokens - start)
        seconds += profile.step_s(chunk, chunk * (start + chunk), batch, context, chunk * start)
    return seconds


def fit_nonnegative(features: np.ndarray, times: np.ndarray) -> tuple[float, ...]:
    """Least squares with the coefficients clipped at zero (refit without negatives)."""
    active = list(range(features.shape[1]))
    coeffs = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], times, rcond=None)
        if (solution >= 0).all():
            coeffs[active] = solution
            break
        active = [a for a, s in zip(active, solution, strict=True) if s >= 0]
    return tuple(float(c) for c in coeffs)


def fit_prefill(samples: list[tuple[int, float, float]]) -> tuple[float, float, float]:
    """samples: (batched tokens, sum of squared chunk lengths, seconds)."""
    data = np.asarray(samples, dtype=float)
    features = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
    return fit_nonnegative(features, data[:, 2])


def fit_decode(samples: list[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """d0..d3 from samples (batch size, total context tokens, seconds), each weighted by
    1/seconds (relative error, as fit_colocated): a one-row step counts as much as one of 64.

    Why relative and why B^2: fitted by absolute error on 1-64 rows at per-row contexts of at
    most 512, the linear model was set by its largest steps, and serving's rows (400-500
    tokens online, 1,000-1,400 in chat) ran 0.87-1.22x it (benchmarks/engine_shapes.py).
    Re-predicted from three planner validations' step logs, this shape fitted on serving's
    grid took the tight-TPOT cells within 10 pp in all three (benchmarks/README.md, "How the
    planner's model got where it is")."""
    data = np.asarray(samples, dtype=float)
    batch, context, seconds = data.T
    features = np.column_stack([np.ones(len(data)), batch, context, batch * batch])
    weights = 1.0 / np.maximum(seconds, 1e-6)
    return fit_nonnegative(features * weights[:, None], seconds * weights)


def fit_colocated(prefill: list[tuple[int, float, float]], decode: list[tuple[int, int, float]],
                  mixed: list[tuple[int, float, int, int, float]]) -> tuple[float, ...]:
    """The mixed-step model c0..c6 on every sample: prefill (T, Q, s), decode (B, C, s) and
    mixed (T, Q, B, C, s) steps; each sample weighted by 1/seconds, so that short decode
    steps count as much as long prefill ones (relative, not absolute, error is minimised)."""
    rows = ([(t, q, 0, 0, s) for t, q, s in prefill] + [(0, 0, b, c, s) for b, c, s in decode]
            + [tuple(sample) for sample in mixed])
    data = np.asarray(rows, dtype=float)
    t, q, b, c, seconds = data.T
    features = np.column_stack([np.ones(len(data)), t, q, b, c, t * t, (t > 0) & (b > 0)])
    weights = 1.0 / np.maximum(seconds, 1e-6)
    return fit_nonnegative(features * weights[:, None], seconds * weights)


def fit_cached_attention(samples: list[tuple[float, float, float]]) -> float:
    """The K term's coefficient (p3 or c7) from steps over a cached prefix, given as (K,
    measured seconds, seconds the model gives without the term): what the model leaves
    over, per unit of K, by least squares on relative error (each step weighted by
    1/measured, as fit_colocated does); at least 0."""
    if not samples:
        return 0.0
    data = np.asarray(samples, dtype=float)
    cached, measured, model = data.T
    weights = 1.0 / np.maximum(measured, 1e-6)
    return fit_nonnegative((cached * weights)[:, None], (measured - model) * weights)[0]
