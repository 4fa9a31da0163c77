from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingOptions(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "first_position", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "json_schema", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    first_position: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    json_schema: str
    prompt_logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: bool = ..., first_position: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., json_schema: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_token_ids", "top_logprobs")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "model", "layout", "kv_transports", "kv_endpoint", "max_model_len", "vocab_size", "cache_root", "prefix_caching")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_ROOT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    model: str
    layout: KVLayout
    kv_transports: _containers.RepeatedScalarFieldContainer[str]
    kv_endpoint: str
    max_model_len: int
    vocab_size: int
    cache_root: bytes
    prefix_caching: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., model: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., kv_transports: _Optional[_Iterable[str]] = ..., kv_endpoint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., cache_root: _Optional[bytes] = ..., prefix_caching: bool = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_waiting", "num_running", "num_waiting_for_kv", "queued_prefill_tokens", "num_free_blocks", "num_total_blocks", "num_preemptions", "num_finished", "num_failed_transfers", "draining", "prefix_cache_queries", "prefix_cache_hit_tokens", "num_cached_blocks", "kv_bytes_received", "kv_bytes_sent", "prefill_decisions", "prefix_cache_query_tokens", "step_seconds", "batch_size", "prefill_tokens_computed", "decode_tokens_computed", "transfers", "kv_tier_hit_tokens", "kv_tier_decisions", "kv_tier_blocks_written", "kv_tier_bytes", "kv_tier_read_bandwidth", "kv_tier_store")
    class PrefillDecisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvTierDecisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvTierStoreEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BLOCKS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_STORE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_waiting: int
    num_running: int
    num_waiting_for_kv: int
    queued_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    num_finished: int
    num_failed_transfers: int
    draining: bool
    prefix_cache_queries: int
    prefix_cache_hit_tokens: int
    num_cached_blocks: int
    kv_bytes_received: int
    kv_bytes_sent: int
    prefill_decisions: _containers.ScalarMap[str, int]
    prefix_cache_query_tokens: int
    step_seconds: Histogram
    batch_size: Histogram
    prefill_tokens_computed: int
    decode_tokens_computed: int
    transfers: _containers.RepeatedCompositeFieldContainer[TransferStats]
    kv_tier_hit_tokens: int
    kv_tier_decisions: _containers.ScalarMap[str, int]
    kv_tier_blocks_written: int
    kv_tier_bytes: int
    kv_tier_read_bandwidth: float
    kv_tier_store: _containers.ScalarMap[str, int]
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_failed_transfers: _Optional[int] = ..., draining: bool = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., prefill_decisions: _Optional[_Mapping[str, int]] = ..., prefix_cache_query_tokens: _Optional[int] = ..., step_seconds: _Optional[_Union[Histogram, _Mapping]] = ..., batch_size: _Optional[_Union[Histogram, _Mapping]] = ..., prefill_tokens_computed: _Optional[int] = ..., decode_tokens_computed: _Optional[int] = ..., transfers: _Optional[_Iterable[_Union[TransferStats, _Mapping]]] = ..., kv_tier_hit_tokens: _Optional[int] = ..., kv_tier_decisions: _Optional[_Mapping[str, int]] = ..., kv_tier_blocks_written: _Optional[int] = ..., kv_tier_bytes: _Optional[int] = ..., kv_tier_read_bandwidth: _Optional[float] = ..., kv_tier_store: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("bounds", "counts", "sum")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("transport", "direction", "bytes", "seconds", "failures")
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    transport: str
    direction: str
    bytes: int
    seconds: Histogram
    failures: _containers.ScalarMap[str, int]
    def __init__(self, transport: _Optional[str] = ..., direction: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[_Union[Histogram, _Mapping]] = ..., failures: _Optional[_Mapping[str, int]] = ...) -> None: ...

class CacheEventsReply(_message.Message):
    __slots__ = ("next_cursor", "reset", "stored", "removed", "since", "tier_stored", "tier_removed", "tier")
    NEXT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    next_cursor: int
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    since: int
    tier_stored: _containers.RepeatedScalarFieldContainer[int]
    tier_removed: _containers.RepeatedScalarFieldContainer[int]
    tier: str
    def __init__(self, next_cursor: _Optional[int] = ..., reset: bool = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., since: _Optional[int] = ..., tier_stored: _Optional[_Iterable[int]] = ..., tier_removed: _Optional[_Iterable[int]] = ..., tier: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("cursor", "interval_ms", "heartbeat_ms")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    interval_ms: int
    heartbeat_ms: int
    def __init__(self, cursor: _Optional[int] = ..., interval_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ...) -> None: ...

class WorkerUpdate(_message.Message):
    __slots__ = ("seq", "stats", "cache", "stalled")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    STALLED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stats: WorkerStats
    cache: CacheEventsReply
    stalled: bool
    def __init__(self, seq: _Optional[int] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ..., cache: _Optional[_Union[CacheEventsReply, _Mapping]] = ..., stalled: bool = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortReply(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: bool = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "prefill_addresses", "kv_transport", "prefill_queued_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    prefill_addresses: _containers.RepeatedScalarFieldContainer[str]
    kv_transport: str
    prefill_queued_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., prefill_addresses: _Optional[_Iterable[str]] = ..., kv_transport: _Optional[str] = ..., prefill_queued_tokens: _Optional[int] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "num_prompt_tokens", "prefilled_by", "num_cached_tokens", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_BY_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    num_prompt_tokens: int
    prefilled_by: str
    num_cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., prefilled_by: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "seed", "layout", "kv_transport", "kv_endpoint", "transfer_id", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    seed: int
    layout: KVLayout
    kv_transport: str
    kv_endpoint: str
    transfer_id: int
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., seed: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., kv_transport: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., transfer_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("transfer_id", "ok")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    ok: bool
    def __init__(self, transfer_id: _Optional[int] = ..., ok: bool = ...) -> None: ...

class PrefillClientMessage(_message.Message):
    __slots__ = ("start", "ack")
    START_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    start: PrefillRequest
    ack: KVAck
    def __init__(self, start: _Optional[_Union[PrefillRequest, _Mapping]] = ..., ack: _Optional[_Union[KVAck, _Mapping]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("transfer_id", "layer", "token_start", "num_tokens", "data")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    layer: int
    token_start: int
    num_tokens: int
    data: bytes
    def __init__(self, transfer_id: _Optional[int] = ..., layer: _Optional[int] = ..., token_start: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token", "num_prompt_tokens", "prefill_worker_id", "num_cached_tokens", "first_logprob", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_prompt_tokens: int
    prefill_worker_id: str
    num_cached_tokens: int
    first_logprob: TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., prefill_worker_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillServerMessage(_message.Message):
    __slots__ = ("kv", "done")
    KV_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    kv: KVChunk
    done: PrefillDone
    def __init__(self, kv: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...
