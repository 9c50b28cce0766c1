from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StreamRequest(_message.Message):
    __slots__ = ("run_id", "rank", "events")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    rank: int
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, run_id: _Optional[str] = ..., rank: _Optional[int] = ..., events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "time_seconds", "run_start", "step", "log", "checkpoint", "heartbeat", "run_end", "replica")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUN_START_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RUN_END_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_seconds: float
    run_start: RunStart
    step: StepReport
    log: LogReport
    checkpoint: CheckpointReport
    heartbeat: Heartbeat
    run_end: RunEnd
    replica: ReplicaDigest
    def __init__(self, seq: _Optional[int] = ..., time_seconds: _Optional[float] = ..., run_start: _Optional[_Union[RunStart, _Mapping]] = ..., step: _Optional[_Union[StepReport, _Mapping]] = ..., log: _Optional[_Union[LogReport, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointReport, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., run_end: _Optional[_Union[RunEnd, _Mapping]] = ..., replica: _Optional[_Union[ReplicaDigest, _Mapping]] = ...) -> None: ...

class RunStart(_message.Message):
    __slots__ = ("trainer", "world_size", "output_dir", "config", "config_text", "versions", "membership", "preflight", "initial_adapter", "attestation", "sharded", "host", "wrapper", "requested_wrapper", "stop_token", "heads", "resume", "trainable_params_by_dtype", "dataset_rows", "baseline", "baseline_name")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class ConfigTextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TrainableParamsByDtypeEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    CONFIG_TEXT_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    PREFLIGHT_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    SHARDED_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    WRAPPER_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_WRAPPER_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMS_BY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATASET_ROWS_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    BASELINE_NAME_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    world_size: int
    output_dir: str
    config: _containers.ScalarMap[str, float]
    config_text: _containers.ScalarMap[str, str]
    versions: _containers.ScalarMap[str, str]
    membership: OptimizerMembership
    preflight: Preflight
    initial_adapter: AdapterDigest
    attestation: str
    sharded: bool
    host: str
    wrapper: str
    requested_wrapper: str
    stop_token: StopTokenCheck
    heads: HeadCheck
    resume: Resume
    trainable_params_by_dtype: _containers.ScalarMap[str, int]
    dataset_rows: DatasetRows
    baseline: str
    baseline_name: str
    def __init__(self, trainer: _Optional[str] = ..., world_size: _Optional[int] = ..., output_dir: _Optional[str] = ..., config: _Optional[_Mapping[str, float]] = ..., config_text: _Optional[_Mapping[str, str]] = ..., versions: _Optional[_Mapping[str, str]] = ..., membership: _Optional[_Union[OptimizerMembership, _Mapping]] = ..., preflight: _Optional[_Union[Preflight, _Mapping]] = ..., initial_adapter: _Optional[_Union[AdapterDigest, _Mapping]] = ..., attestation: _Optional[str] = ..., sharded: _Optional[bool] = ..., host: _Optional[str] = ..., wrapper: _Optional[str] = ..., requested_wrapper: _Optional[str] = ..., stop_token: _Optional[_Union[StopTokenCheck, _Mapping]] = ..., heads: _Optional[_Union[HeadCheck, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., trainable_params_by_dtype: _Optional[_Mapping[str, int]] = ..., dataset_rows: _Optional[_Union[DatasetRows, _Mapping]] = ..., baseline: _Optional[str] = ..., baseline_name: _Optional[str] = ...) -> None: ...

class StopTokenCheck(_message.Message):
    __slots__ = ("token", "token_id", "sequences", "in_inputs", "in_labels", "full_rows", "outside_loss")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    IN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    IN_LABELS_FIELD_NUMBER: _ClassVar[int]
    FULL_ROWS_FIELD_NUMBER: _ClassVar[int]
    OUTSIDE_LOSS_FIELD_NUMBER: _ClassVar[int]
    token: str
    token_id: int
    sequences: int
    in_inputs: int
    in_labels: int
    full_rows: int
    outside_loss: int
    def __init__(self, token: _Optional[str] = ..., token_id: _Optional[int] = ..., sequences: _Optional[int] = ..., in_inputs: _Optional[int] = ..., in_labels: _Optional[int] = ..., full_rows: _Optional[int] = ..., outside_loss: _Optional[int] = ...) -> None: ...

class HeadCheck(_message.Message):
    __slots__ = ("heads", "new_heads", "saved_heads", "trainable_heads")
    HEADS_FIELD_NUMBER: _ClassVar[int]
    NEW_HEADS_FIELD_NUMBER: _ClassVar[int]
    SAVED_HEADS_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_HEADS_FIELD_NUMBER: _ClassVar[int]
    heads: _containers.RepeatedScalarFieldContainer[str]
    new_heads: _containers.RepeatedScalarFieldContainer[str]
    saved_heads: _containers.RepeatedScalarFieldContainer[str]
    trainable_heads: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, heads: _Optional[_Iterable[str]] = ..., new_heads: _Optional[_Iterable[str]] = ..., saved_heads: _Optional[_Iterable[str]] = ..., trainable_heads: _Optional[_Iterable[str]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("checkpoint", "step", "checkpoint_adapter", "first_loss", "last_loss")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    step: int
    checkpoint_adapter: AdapterDigest
    first_loss: float
    last_loss: float
    def __init__(self, checkpoint: _Optional[str] = ..., step: _Optional[int] = ..., checkpoint_adapter: _Optional[_Union[AdapterDigest, _Mapping]] = ..., first_loss: _Optional[float] = ..., last_loss: _Optional[float] = ...) -> None: ...

class DatasetRows(_message.Message):
    __slots__ = ("given", "kept")
    GIVEN_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    given: int
    kept: int
    def __init__(self, given: _Optional[int] = ..., kept: _Optional[int] = ...) -> None: ...

class OptimizerMembership(_message.Message):
    __slots__ = ("optimizer_tensors", "optimizer_params", "trainable_tensors", "trainable_params", "trainable_not_in_optimizer_tensors", "adapter_tensors", "adapter_params", "adapters", "layout")
    OPTIMIZER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_NOT_IN_OPTIMIZER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    optimizer_tensors: int
    optimizer_params: int
    trainable_tensors: int
    trainable_params: int
    trainable_not_in_optimizer_tensors: int
    adapter_tensors: int
    adapter_params: int
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterCoverage]
    layout: str
    def __init__(self, optimizer_tensors: _Optional[int] = ..., optimizer_params: _Optional[int] = ..., trainable_tensors: _Optional[int] = ..., trainable_params: _Optional[int] = ..., trainable_not_in_optimizer_tensors: _Optional[int] = ..., adapter_tensors: _Optional[int] = ..., adapter_params: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[AdapterCoverage, _Mapping]]] = ..., layout: _Optional[str] = ...) -> None: ...

class AdapterCoverage(_message.Message):
    __slots__ = ("name", "tensors", "params", "in_optimizer_tensors", "active")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    IN_OPTIMIZER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensors: int
    params: int
    in_optimizer_tensors: int
    active: bool
    def __init__(self, name: _Optional[str] = ..., tensors: _Optional[int] = ..., params: _Optional[int] = ..., in_optimizer_tensors: _Optional[int] = ..., active: _Optional[bool] = ...) -> None: ...

class Preflight(_message.Message):
    __slots__ = ("is_peft", "peft_type", "requested_target_modules", "target_modules_regex", "unmatched_target_modules", "embedding_rows", "base_vocab_size", "tokenizer_size", "modules_to_save", "active_adapter", "lora_rank", "embedding_module", "trainable_token_modules", "adapter_layer_names")
    IS_PEFT_FIELD_NUMBER: _ClassVar[int]
    PEFT_TYPE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_REGEX_FIELD_NUMBER: _ClassVar[int]
    UNMATCHED_TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    BASE_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODULES_TO_SAVE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_MODULE_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_TOKEN_MODULES_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LAYER_NAMES_FIELD_NUMBER: _ClassVar[int]
    is_peft: bool
    peft_type: str
    requested_target_modules: _containers.RepeatedScalarFieldContainer[str]
    target_modules_regex: str
    unmatched_target_modules: _containers.RepeatedScalarFieldContainer[str]
    embedding_rows: int
    base_vocab_size: int
    tokenizer_size: int
    modules_to_save: _containers.RepeatedScalarFieldContainer[str]
    active_adapter: str
    lora_rank: int
    embedding_module: str
    trainable_token_modules: _containers.RepeatedScalarFieldContainer[str]
    adapter_layer_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, is_peft: _Optional[bool] = ..., peft_type: _Optional[str] = ..., requested_target_modules: _Optional[_Iterable[str]] = ..., target_modules_regex: _Optional[str] = ..., unmatched_target_modules: _Optional[_Iterable[str]] = ..., embedding_rows: _Optional[int] = ..., base_vocab_size: _Optional[int] = ..., tokenizer_size: _Optional[int] = ..., modules_to_save: _Optional[_Iterable[str]] = ..., active_adapter: _Optional[str] = ..., lora_rank: _Optional[int] = ..., embedding_module: _Optional[str] = ..., trainable_token_modules: _Optional[_Iterable[str]] = ..., adapter_layer_names: _Optional[_Iterable[str]] = ...) -> None: ...

class AdapterDigest(_message.Message):
    __slots__ = ("combined", "tensors", "bytes")
    class TensorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMBINED_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    combined: str
    tensors: _containers.ScalarMap[str, str]
    bytes: int
    def __init__(self, combined: _Optional[str] = ..., tensors: _Optional[_Mapping[str, str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "learning_rate", "update_sq_sum", "param_sq_sum", "watched_tensors", "watched_params", "optimizer_params", "unchanged_tensors", "grad_not_in_optimizer_tensors", "nonfinite_update_tensors", "grad_sq_sum", "groups", "sampled", "grad_not_in_optimizer_params", "unchanged_elements", "optimizer_step_skipped", "adalora_rank_pattern_set", "grad_measured", "declared_frozen_tensors", "declared_frozen_moved_tensors", "local_seconds", "step_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SQ_SUM_FIELD_NUMBER: _ClassVar[int]
    PARAM_SQ_SUM_FIELD_NUMBER: _ClassVar[int]
    WATCHED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    WATCHED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    GRAD_NOT_IN_OPTIMIZER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_UPDATE_TENSORS_FIELD_NUMBER: _ClassVar[int]
    GRAD_SQ_SUM_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    GRAD_NOT_IN_OPTIMIZER_PARAMS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEP_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    ADALORA_RANK_PATTERN_SET_FIELD_NUMBER: _ClassVar[int]
    GRAD_MEASURED_FIELD_NUMBER: _ClassVar[int]
    DECLARED_FROZEN_TENSORS_FIELD_NUMBER: _ClassVar[int]
    DECLARED_FROZEN_MOVED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    learning_rate: float
    update_sq_sum: float
    param_sq_sum: float
    watched_tensors: int
    watched_params: int
    optimizer_params: int
    unchanged_tensors: int
    grad_not_in_optimizer_tensors: int
    nonfinite_update_tensors: int
    grad_sq_sum: float
    groups: _containers.RepeatedCompositeFieldContainer[GroupUpdate]
    sampled: bool
    grad_not_in_optimizer_params: int
    unchanged_elements: int
    optimizer_step_skipped: bool
    adalora_rank_pattern_set: bool
    grad_measured: bool
    declared_frozen_tensors: int
    declared_frozen_moved_tensors: int
    local_seconds: float
    step_seconds: float
    def __init__(self, step: _Optional[int] = ..., learning_rate: _Optional[float] = ..., update_sq_sum: _Optional[float] = ..., param_sq_sum: _Optional[float] = ..., watched_tensors: _Optional[int] = ..., watched_params: _Optional[int] = ..., optimizer_params: _Optional[int] = ..., unchanged_tensors: _Optional[int] = ..., grad_not_in_optimizer_tensors: _Optional[int] = ..., nonfinite_update_tensors: _Optional[int] = ..., grad_sq_sum: _Optional[float] = ..., groups: _Optional[_Iterable[_Union[GroupUpdate, _Mapping]]] = ..., sampled: _Optional[bool] = ..., grad_not_in_optimizer_params: _Optional[int] = ..., unchanged_elements: _Optional[int] = ..., optimizer_step_skipped: _Optional[bool] = ..., adalora_rank_pattern_set: _Optional[bool] = ..., grad_measured: _Optional[bool] = ..., declared_frozen_tensors: _Optional[int] = ..., declared_frozen_moved_tensors: _Optional[int] = ..., local_seconds: _Optional[float] = ..., step_seconds: _Optional[float] = ...) -> None: ...

class GroupUpdate(_message.Message):
    __slots__ = ("name", "kind", "update_sq_sum", "tensors", "unchanged_tensors", "optimizer_tensors", "elements", "unchanged_elements", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    UPDATE_SQ_SUM_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_TENSORS_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    UNCHANGED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    update_sq_sum: float
    tensors: int
    unchanged_tensors: int
    optimizer_tensors: int
    elements: int
    unchanged_elements: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., update_sq_sum: _Optional[float] = ..., tensors: _Optional[int] = ..., unchanged_tensors: _Optional[int] = ..., optimizer_tensors: _Optional[int] = ..., elements: _Optional[int] = ..., unchanged_elements: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class LogReport(_message.Message):
    __slots__ = ("step", "values", "dropped_keys")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_KEYS_FIELD_NUMBER: _ClassVar[int]
    step: int
    values: _containers.ScalarMap[str, float]
    dropped_keys: int
    def __init__(self, step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., dropped_keys: _Optional[int] = ...) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("step", "path", "adapter")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    adapter: AdapterDigest
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., adapter: _Optional[_Union[AdapterDigest, _Mapping]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("step", "dropped_events", "queued_events", "began_step", "where", "phase", "phase_step", "phase_pass", "phase_seconds_ago", "evaluated_batches")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[Heartbeat.Phase]
        PHASE_FORWARD: _ClassVar[Heartbeat.Phase]
        PHASE_BACKWARD: _ClassVar[Heartbeat.Phase]
        PHASE_BACKWARD_DONE: _ClassVar[Heartbeat.Phase]
        PHASE_OPTIMIZER_STEP: _ClassVar[Heartbeat.Phase]
    PHASE_UNSPECIFIED: Heartbeat.Phase
    PHASE_FORWARD: Heartbeat.Phase
    PHASE_BACKWARD: Heartbeat.Phase
    PHASE_BACKWARD_DONE: Heartbeat.Phase
    PHASE_OPTIMIZER_STEP: Heartbeat.Phase
    STEP_FIELD_NUMBER: _ClassVar[int]
    DROPPED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    BEGAN_STEP_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_STEP_FIELD_NUMBER: _ClassVar[int]
    PHASE_PASS_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    step: int
    dropped_events: int
    queued_events: int
    began_step: int
    where: str
    phase: Heartbeat.Phase
    phase_step: int
    phase_pass: int
    phase_seconds_ago: float
    evaluated_batches: int
    def __init__(self, step: _Optional[int] = ..., dropped_events: _Optional[int] = ..., queued_events: _Optional[int] = ..., began_step: _Optional[int] = ..., where: _Optional[str] = ..., phase: _Optional[_Union[Heartbeat.Phase, str]] = ..., phase_step: _Optional[int] = ..., phase_pass: _Optional[int] = ..., phase_seconds_ago: _Optional[float] = ..., evaluated_batches: _Optional[int] = ...) -> None: ...

class ReplicaDigest(_message.Message):
    __slots__ = ("step", "structure", "values", "sizes", "names")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STRUCTURE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    step: int
    structure: str
    values: _containers.RepeatedScalarFieldContainer[float]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, step: _Optional[int] = ..., structure: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ..., sizes: _Optional[_Iterable[int]] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class RunEnd(_message.Message):
    __slots__ = ("step", "reason")
    STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    step: int
    reason: str
    def __init__(self, step: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("ack_seq", "directives", "error", "firing", "verdicts", "report_command")
    ACK_SEQ_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRING_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    REPORT_COMMAND_FIELD_NUMBER: _ClassVar[int]
    ack_seq: int
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    error: str
    firing: _containers.RepeatedScalarFieldContainer[str]
    verdicts: _containers.RepeatedCompositeFieldContainer[VerdictNotice]
    report_command: str
    def __init__(self, ack_seq: _Optional[int] = ..., directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ..., error: _Optional[str] = ..., firing: _Optional[_Iterable[str]] = ..., verdicts: _Optional[_Iterable[_Union[VerdictNotice, _Mapping]]] = ..., report_command: _Optional[str] = ...) -> None: ...

class VerdictNotice(_message.Message):
    __slots__ = ("detector", "severity", "policy", "incident", "step", "cause", "fix", "runbook_url", "cause_rank", "evidence")
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INCIDENT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    FIX_FIELD_NUMBER: _ClassVar[int]
    RUNBOOK_URL_FIELD_NUMBER: _ClassVar[int]
    CAUSE_RANK_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    detector: str
    severity: str
    policy: str
    incident: int
    step: int
    cause: str
    fix: str
    runbook_url: str
    cause_rank: int
    evidence: str
    def __init__(self, detector: _Optional[str] = ..., severity: _Optional[str] = ..., policy: _Optional[str] = ..., incident: _Optional[int] = ..., step: _Optional[int] = ..., cause: _Optional[str] = ..., fix: _Optional[str] = ..., runbook_url: _Optional[str] = ..., cause_rank: _Optional[int] = ..., evidence: _Optional[str] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("action", "detector", "reason")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[Directive.Action]
        ACTION_STOP: _ClassVar[Directive.Action]
        ACTION_ABORT: _ClassVar[Directive.Action]
    ACTION_UNSPECIFIED: Directive.Action
    ACTION_STOP: Directive.Action
    ACTION_ABORT: Directive.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    action: Directive.Action
    detector: str
    reason: str
    def __init__(self, action: _Optional[_Union[Directive.Action, str]] = ..., detector: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("runs", "warnings")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunStatus]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunStatus, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "trainer", "ranks", "step", "last_seen_seconds", "ended", "findings", "end_reason", "actions", "wrapper", "sharded", "silences", "started_at", "ended_at", "incarnation", "baseline")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    END_REASON_FIELD_NUMBER: _ClassVar[int]
    ACTIONS_FIELD_NUMBER: _ClassVar[int]
    WRAPPER_FIELD_NUMBER: _ClassVar[int]
    SHARDED_FIELD_NUMBER: _ClassVar[int]
    SILENCES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BASELINE_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    trainer: str
    ranks: _containers.RepeatedScalarFieldContainer[int]
    step: int
    last_seen_seconds: float
    ended: bool
    findings: _containers.RepeatedCompositeFieldContainer[Finding]
    end_reason: str
    actions: _containers.RepeatedCompositeFieldContainer[ActionTaken]
    wrapper: str
    sharded: bool
    silences: _containers.RepeatedCompositeFieldContainer[SilenceStatus]
    started_at: float
    ended_at: float
    incarnation: int
    baseline: str
    def __init__(self, run_id: _Optional[str] = ..., trainer: _Optional[str] = ..., ranks: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., last_seen_seconds: _Optional[float] = ..., ended: _Optional[bool] = ..., findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ..., end_reason: _Optional[str] = ..., actions: _Optional[_Iterable[_Union[ActionTaken, _Mapping]]] = ..., wrapper: _Optional[str] = ..., sharded: _Optional[bool] = ..., silences: _Optional[_Iterable[_Union[SilenceStatus, _Mapping]]] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., incarnation: _Optional[int] = ..., baseline: _Optional[str] = ...) -> None: ...

class SilenceStatus(_message.Message):
    __slots__ = ("detector", "until", "reason")
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    detector: str
    until: float
    reason: str
    def __init__(self, detector: _Optional[str] = ..., until: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("run_id", "reason", "attestation")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    reason: str
    attestation: str
    def __init__(self, run_id: _Optional[str] = ..., reason: _Optional[str] = ..., attestation: _Optional[str] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("already", "message", "step")
    ALREADY_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    already: bool
    message: str
    step: int
    def __init__(self, already: _Optional[bool] = ..., message: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class SilenceRequest(_message.Message):
    __slots__ = ("run_id", "detector", "seconds", "reason", "attestation")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    detector: str
    seconds: float
    reason: str
    attestation: str
    def __init__(self, run_id: _Optional[str] = ..., detector: _Optional[str] = ..., seconds: _Optional[float] = ..., reason: _Optional[str] = ..., attestation: _Optional[str] = ...) -> None: ...

class SilenceResponse(_message.Message):
    __slots__ = ("until", "message")
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    until: float
    message: str
    def __init__(self, until: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class ActionTaken(_message.Message):
    __slots__ = ("detector", "action", "result", "time", "step")
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    detector: str
    action: str
    result: str
    time: float
    step: int
    def __init__(self, detector: _Optional[str] = ..., action: _Optional[str] = ..., result: _Optional[str] = ..., time: _Optional[float] = ..., step: _Optional[int] = ...) -> None: ...

class Finding(_message.Message):
    __slots__ = ("detector", "severity", "firing", "step", "summary", "evidence", "policy", "state", "evidence_at_firing")
    class EvidenceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EvidenceAtFiringEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DETECTOR_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    FIRING_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_AT_FIRING_FIELD_NUMBER: _ClassVar[int]
    detector: str
    severity: str
    firing: bool
    step: int
    summary: str
    evidence: _containers.ScalarMap[str, str]
    policy: str
    state: str
    evidence_at_firing: _containers.ScalarMap[str, str]
    def __init__(self, detector: _Optional[str] = ..., severity: _Optional[str] = ..., firing: _Optional[bool] = ..., step: _Optional[int] = ..., summary: _Optional[str] = ..., evidence: _Optional[_Mapping[str, str]] = ..., policy: _Optional[str] = ..., state: _Optional[str] = ..., evidence_at_firing: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SignSummaryRequest(_message.Message):
    __slots__ = ("run_id", "attestation", "adapter", "step", "path")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ATTESTATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    attestation: str
    adapter: AdapterDigest
    step: int
    path: str
    def __init__(self, run_id: _Optional[str] = ..., attestation: _Optional[str] = ..., adapter: _Optional[_Union[AdapterDigest, _Mapping]] = ..., step: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class SignSummaryResponse(_message.Message):
    __slots__ = ("body", "signature", "key_id")
    BODY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    signature: bytes
    key_id: str
    def __init__(self, body: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., key_id: _Optional[str] = ...) -> None: ...
