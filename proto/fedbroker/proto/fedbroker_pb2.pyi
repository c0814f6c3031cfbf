from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Trailer(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class DPPolicy(_message.Message):
    __slots__ = ("noise_multiplier", "max_grad_norm", "delta", "epsilon_budget", "mode", "local_floor_epsilon")
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EPSILON_BUDGET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FLOOR_EPSILON_FIELD_NUMBER: _ClassVar[int]
    noise_multiplier: float
    max_grad_norm: float
    delta: float
    epsilon_budget: float
    mode: str
    local_floor_epsilon: float
    def __init__(self, noise_multiplier: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., delta: _Optional[float] = ..., epsilon_budget: _Optional[float] = ..., mode: _Optional[str] = ..., local_floor_epsilon: _Optional[float] = ...) -> None: ...

class Registration(_message.Message):
    __slots__ = ("worker_id", "categories", "label_histogram", "dp_policy", "dp_enabled", "epsilon_spent", "device", "num_samples", "input_shape", "num_classes", "evaluation_samples", "software_version", "started_unix")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    LABEL_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    DP_POLICY_FIELD_NUMBER: _ClassVar[int]
    DP_ENABLED_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    categories: _containers.RepeatedScalarFieldContainer[str]
    label_histogram: _containers.RepeatedScalarFieldContainer[int]
    dp_policy: DPPolicy
    dp_enabled: bool
    epsilon_spent: float
    device: str
    num_samples: int
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    num_classes: int
    evaluation_samples: int
    software_version: str
    started_unix: float
    def __init__(self, worker_id: _Optional[str] = ..., categories: _Optional[_Iterable[str]] = ..., label_histogram: _Optional[_Iterable[int]] = ..., dp_policy: _Optional[_Union[DPPolicy, _Mapping]] = ..., dp_enabled: _Optional[bool] = ..., epsilon_spent: _Optional[float] = ..., device: _Optional[str] = ..., num_samples: _Optional[int] = ..., input_shape: _Optional[_Iterable[int]] = ..., num_classes: _Optional[int] = ..., evaluation_samples: _Optional[int] = ..., software_version: _Optional[str] = ..., started_unix: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("worker_id", "epsilon_spent", "state", "budget_limited", "epsilon_left", "job_costs")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_LIMITED_FIELD_NUMBER: _ClassVar[int]
    EPSILON_LEFT_FIELD_NUMBER: _ClassVar[int]
    JOB_COSTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epsilon_spent: float
    state: str
    budget_limited: bool
    epsilon_left: float
    job_costs: _containers.RepeatedCompositeFieldContainer[JobCost]
    def __init__(self, worker_id: _Optional[str] = ..., epsilon_spent: _Optional[float] = ..., state: _Optional[str] = ..., budget_limited: _Optional[bool] = ..., epsilon_left: _Optional[float] = ..., job_costs: _Optional[_Iterable[_Union[JobCost, _Mapping]]] = ...) -> None: ...

class JobCost(_message.Message):
    __slots__ = ("job_id", "known", "next_round_epsilon")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    NEXT_ROUND_EPSILON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    known: bool
    next_round_epsilon: float
    def __init__(self, job_id: _Optional[str] = ..., known: _Optional[bool] = ..., next_round_epsilon: _Optional[float] = ...) -> None: ...

class TaskOutcome(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "status", "reason", "epsilon", "train_loss", "seconds", "num_samples", "epsilon_local_floor")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[TaskOutcome.Status]
        REFUSED: _ClassVar[TaskOutcome.Status]
        FAILED: _ClassVar[TaskOutcome.Status]
        UPLOADED: _ClassVar[TaskOutcome.Status]
    STATUS_UNSPECIFIED: TaskOutcome.Status
    REFUSED: TaskOutcome.Status
    FAILED: TaskOutcome.Status
    UPLOADED: TaskOutcome.Status
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EPSILON_LOCAL_FLOOR_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    status: TaskOutcome.Status
    reason: str
    epsilon: float
    train_loss: float
    seconds: float
    num_samples: int
    epsilon_local_floor: float
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., status: _Optional[_Union[TaskOutcome.Status, str]] = ..., reason: _Optional[str] = ..., epsilon: _Optional[float] = ..., train_loss: _Optional[float] = ..., seconds: _Optional[float] = ..., num_samples: _Optional[int] = ..., epsilon_local_floor: _Optional[float] = ...) -> None: ...

class RoundTask(_message.Message):
    __slots__ = ("job_id", "round", "training_json", "category", "model_version", "aggregator_target", "deadline_unix", "population_distribution", "participants", "seed", "aggregation_json", "recorded_epsilon_spent", "settings_digest", "settings")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TRAINING_JSON_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_TARGET_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    POPULATION_DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_JSON_FIELD_NUMBER: _ClassVar[int]
    RECORDED_EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    training_json: str
    category: str
    model_version: int
    aggregator_target: str
    deadline_unix: float
    population_distribution: _containers.RepeatedScalarFieldContainer[float]
    participants: int
    seed: int
    aggregation_json: str
    recorded_epsilon_spent: float
    settings_digest: str
    settings: JobSettings
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., training_json: _Optional[str] = ..., category: _Optional[str] = ..., model_version: _Optional[int] = ..., aggregator_target: _Optional[str] = ..., deadline_unix: _Optional[float] = ..., population_distribution: _Optional[_Iterable[float]] = ..., participants: _Optional[int] = ..., seed: _Optional[int] = ..., aggregation_json: _Optional[str] = ..., recorded_epsilon_spent: _Optional[float] = ..., settings_digest: _Optional[str] = ..., settings: _Optional[_Union[JobSettings, _Mapping]] = ...) -> None: ...

class TrainingSettings(_message.Message):
    __slots__ = ("rounds", "local_epochs", "batch_size", "optimizer", "lr", "momentum", "proximal_mu")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    PROXIMAL_MU_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    local_epochs: int
    batch_size: int
    optimizer: str
    lr: float
    momentum: float
    proximal_mu: float
    def __init__(self, rounds: _Optional[int] = ..., local_epochs: _Optional[int] = ..., batch_size: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., proximal_mu: _Optional[float] = ...) -> None: ...

class AlgorithmChoice(_message.Message):
    __slots__ = ("name", "params_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    params_json: str
    def __init__(self, name: _Optional[str] = ..., params_json: _Optional[str] = ...) -> None: ...

class AggregationSettings(_message.Message):
    __slots__ = ("alignment", "weighting", "selection", "robust", "secure", "max_update_value", "secure_group_size")
    ALIGNMENT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTING_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    ROBUST_FIELD_NUMBER: _ClassVar[int]
    SECURE_FIELD_NUMBER: _ClassVar[int]
    MAX_UPDATE_VALUE_FIELD_NUMBER: _ClassVar[int]
    SECURE_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    alignment: AlgorithmChoice
    weighting: AlgorithmChoice
    selection: AlgorithmChoice
    robust: AlgorithmChoice
    secure: bool
    max_update_value: float
    secure_group_size: int
    def __init__(self, alignment: _Optional[_Union[AlgorithmChoice, _Mapping]] = ..., weighting: _Optional[_Union[AlgorithmChoice, _Mapping]] = ..., selection: _Optional[_Union[AlgorithmChoice, _Mapping]] = ..., robust: _Optional[_Union[AlgorithmChoice, _Mapping]] = ..., secure: _Optional[bool] = ..., max_update_value: _Optional[float] = ..., secure_group_size: _Optional[int] = ...) -> None: ...

class EvaluationSettings(_message.Message):
    __slots__ = ("dataset", "test_fraction", "split_seed", "every", "sites", "patience")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    TEST_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_SEED_FIELD_NUMBER: _ClassVar[int]
    EVERY_FIELD_NUMBER: _ClassVar[int]
    SITES_FIELD_NUMBER: _ClassVar[int]
    PATIENCE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    test_fraction: float
    split_seed: int
    every: int
    sites: str
    patience: int
    def __init__(self, dataset: _Optional[str] = ..., test_fraction: _Optional[float] = ..., split_seed: _Optional[int] = ..., every: _Optional[int] = ..., sites: _Optional[str] = ..., patience: _Optional[int] = ...) -> None: ...

class DataSettings(_message.Message):
    __slots__ = ("standardize", "lower", "upper", "pipeline_json")
    STANDARDIZE_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_JSON_FIELD_NUMBER: _ClassVar[int]
    standardize: str
    lower: _containers.RepeatedScalarFieldContainer[float]
    upper: _containers.RepeatedScalarFieldContainer[float]
    pipeline_json: str
    def __init__(self, standardize: _Optional[str] = ..., lower: _Optional[_Iterable[float]] = ..., upper: _Optional[_Iterable[float]] = ..., pipeline_json: _Optional[str] = ...) -> None: ...

class TaskSettings(_message.Message):
    __slots__ = ("type", "class_weights", "label_smoothing", "labels", "loss", "huber_delta", "classes", "dice_weight")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CLASS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LABEL_SMOOTHING_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    HUBER_DELTA_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    DICE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    type: str
    class_weights: _containers.RepeatedScalarFieldContainer[float]
    label_smoothing: float
    labels: int
    loss: str
    huber_delta: float
    classes: int
    dice_weight: float
    def __init__(self, type: _Optional[str] = ..., class_weights: _Optional[_Iterable[float]] = ..., label_smoothing: _Optional[float] = ..., labels: _Optional[int] = ..., loss: _Optional[str] = ..., huber_delta: _Optional[float] = ..., classes: _Optional[int] = ..., dice_weight: _Optional[float] = ...) -> None: ...

class JobSettings(_message.Message):
    __slots__ = ("job_id", "category", "seed", "training", "aggregation", "evaluation", "data", "task", "model_plan_json", "start_digest", "privacy")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MODEL_PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    START_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PRIVACY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    category: str
    seed: int
    training: TrainingSettings
    aggregation: AggregationSettings
    evaluation: EvaluationSettings
    data: DataSettings
    task: TaskSettings
    model_plan_json: str
    start_digest: str
    privacy: PrivacySettings
    def __init__(self, job_id: _Optional[str] = ..., category: _Optional[str] = ..., seed: _Optional[int] = ..., training: _Optional[_Union[TrainingSettings, _Mapping]] = ..., aggregation: _Optional[_Union[AggregationSettings, _Mapping]] = ..., evaluation: _Optional[_Union[EvaluationSettings, _Mapping]] = ..., data: _Optional[_Union[DataSettings, _Mapping]] = ..., task: _Optional[_Union[TaskSettings, _Mapping]] = ..., model_plan_json: _Optional[str] = ..., start_digest: _Optional[str] = ..., privacy: _Optional[_Union[PrivacySettings, _Mapping]] = ...) -> None: ...

class DistributedDPSettings(_message.Message):
    __slots__ = ("enabled", "noise_multiplier", "clip", "sample_rate", "quorum")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    noise_multiplier: float
    clip: float
    sample_rate: float
    quorum: int
    def __init__(self, enabled: _Optional[bool] = ..., noise_multiplier: _Optional[float] = ..., clip: _Optional[float] = ..., sample_rate: _Optional[float] = ..., quorum: _Optional[int] = ...) -> None: ...

class SiteDPSettings(_message.Message):
    __slots__ = ("enabled", "clipping", "noise_multiplier", "clip_norm", "target_quantile", "clip_lr", "count_noise_multiplier")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    CLIPPING_FIELD_NUMBER: _ClassVar[int]
    NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    TARGET_QUANTILE_FIELD_NUMBER: _ClassVar[int]
    CLIP_LR_FIELD_NUMBER: _ClassVar[int]
    COUNT_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    clipping: str
    noise_multiplier: float
    clip_norm: float
    target_quantile: float
    clip_lr: float
    count_noise_multiplier: float
    def __init__(self, enabled: _Optional[bool] = ..., clipping: _Optional[str] = ..., noise_multiplier: _Optional[float] = ..., clip_norm: _Optional[float] = ..., target_quantile: _Optional[float] = ..., clip_lr: _Optional[float] = ..., count_noise_multiplier: _Optional[float] = ...) -> None: ...

class PrivacySettings(_message.Message):
    __slots__ = ("distributed", "site")
    DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    distributed: DistributedDPSettings
    site: SiteDPSettings
    def __init__(self, distributed: _Optional[_Union[DistributedDPSettings, _Mapping]] = ..., site: _Optional[_Union[SiteDPSettings, _Mapping]] = ...) -> None: ...

class InstallJobRequest(_message.Message):
    __slots__ = ("settings",)
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: JobSettings
    def __init__(self, settings: _Optional[_Union[JobSettings, _Mapping]] = ...) -> None: ...

class InstallJobReply(_message.Message):
    __slots__ = ("digest",)
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    digest: str
    def __init__(self, digest: _Optional[str] = ...) -> None: ...

class GetJobSettingsRequest(_message.Message):
    __slots__ = ("job_id", "worker_id", "digest")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    digest: str
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., digest: _Optional[str] = ...) -> None: ...

class GetJobSettingsReply(_message.Message):
    __slots__ = ("settings", "digest")
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    settings: JobSettings
    digest: str
    def __init__(self, settings: _Optional[_Union[JobSettings, _Mapping]] = ..., digest: _Optional[str] = ...) -> None: ...

class RoundCompleted(_message.Message):
    __slots__ = ("job_id", "round", "model_version", "aggregated", "accuracy", "loss", "final", "seconds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    model_version: int
    aggregated: int
    accuracy: float
    loss: float
    final: bool
    seconds: float
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., model_version: _Optional[int] = ..., aggregated: _Optional[int] = ..., accuracy: _Optional[float] = ..., loss: _Optional[float] = ..., final: _Optional[bool] = ..., seconds: _Optional[float] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("registration", "heartbeat", "task_outcome", "round_task", "round_completed", "share_request", "share_reply", "evaluation_task", "evaluation_report", "site_log")
    REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TASK_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ROUND_TASK_FIELD_NUMBER: _ClassVar[int]
    ROUND_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    SHARE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    SHARE_REPLY_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_TASK_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_REPORT_FIELD_NUMBER: _ClassVar[int]
    SITE_LOG_FIELD_NUMBER: _ClassVar[int]
    registration: Registration
    heartbeat: Heartbeat
    task_outcome: TaskOutcome
    round_task: RoundTask
    round_completed: RoundCompleted
    share_request: ShareRequest
    share_reply: ShareReply
    evaluation_task: EvaluationTask
    evaluation_report: EvaluationReport
    site_log: SiteLog
    def __init__(self, registration: _Optional[_Union[Registration, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., task_outcome: _Optional[_Union[TaskOutcome, _Mapping]] = ..., round_task: _Optional[_Union[RoundTask, _Mapping]] = ..., round_completed: _Optional[_Union[RoundCompleted, _Mapping]] = ..., share_request: _Optional[_Union[ShareRequest, _Mapping]] = ..., share_reply: _Optional[_Union[ShareReply, _Mapping]] = ..., evaluation_task: _Optional[_Union[EvaluationTask, _Mapping]] = ..., evaluation_report: _Optional[_Union[EvaluationReport, _Mapping]] = ..., site_log: _Optional[_Union[SiteLog, _Mapping]] = ...) -> None: ...

class ShareRequest(_message.Message):
    __slots__ = ("job_id", "category", "histogram", "feature_statistics", "lower", "upper", "deadline_unix")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    FEATURE_STATISTICS_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    UPPER_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    category: str
    histogram: bool
    feature_statistics: bool
    lower: _containers.RepeatedScalarFieldContainer[float]
    upper: _containers.RepeatedScalarFieldContainer[float]
    deadline_unix: float
    def __init__(self, job_id: _Optional[str] = ..., category: _Optional[str] = ..., histogram: _Optional[bool] = ..., feature_statistics: _Optional[bool] = ..., lower: _Optional[_Iterable[float]] = ..., upper: _Optional[_Iterable[float]] = ..., deadline_unix: _Optional[float] = ...) -> None: ...

class ShareReply(_message.Message):
    __slots__ = ("job_id", "worker_id", "refused", "reason", "label_histogram", "histogram_noised", "histogram_epsilon", "feature_sum", "feature_sq_sum", "count", "statistics_noised", "statistics_epsilon", "statistics_delta")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LABEL_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_NOISED_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAM_EPSILON_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SUM_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SQ_SUM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_NOISED_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_EPSILON_FIELD_NUMBER: _ClassVar[int]
    STATISTICS_DELTA_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    worker_id: str
    refused: bool
    reason: str
    label_histogram: _containers.RepeatedScalarFieldContainer[int]
    histogram_noised: bool
    histogram_epsilon: float
    feature_sum: _containers.RepeatedScalarFieldContainer[float]
    feature_sq_sum: _containers.RepeatedScalarFieldContainer[float]
    count: int
    statistics_noised: bool
    statistics_epsilon: float
    statistics_delta: float
    def __init__(self, job_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., refused: _Optional[bool] = ..., reason: _Optional[str] = ..., label_histogram: _Optional[_Iterable[int]] = ..., histogram_noised: _Optional[bool] = ..., histogram_epsilon: _Optional[float] = ..., feature_sum: _Optional[_Iterable[float]] = ..., feature_sq_sum: _Optional[_Iterable[float]] = ..., count: _Optional[int] = ..., statistics_noised: _Optional[bool] = ..., statistics_epsilon: _Optional[float] = ..., statistics_delta: _Optional[float] = ...) -> None: ...

class EvaluationTask(_message.Message):
    __slots__ = ("job_id", "round", "model_version", "aggregator_target", "category", "deadline_unix", "task", "pipeline_json")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_TARGET_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_JSON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    model_version: int
    aggregator_target: str
    category: str
    deadline_unix: float
    task: TaskSettings
    pipeline_json: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., model_version: _Optional[int] = ..., aggregator_target: _Optional[str] = ..., category: _Optional[str] = ..., deadline_unix: _Optional[float] = ..., task: _Optional[_Union[TaskSettings, _Mapping]] = ..., pipeline_json: _Optional[str] = ...) -> None: ...

class EvaluationReport(_message.Message):
    __slots__ = ("job_id", "round", "model_version", "worker_id", "refused", "reason", "loss", "accuracy", "num_samples", "sums")
    class SumsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SUMS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    model_version: int
    worker_id: str
    refused: bool
    reason: str
    loss: float
    accuracy: float
    num_samples: int
    sums: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., model_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., refused: _Optional[bool] = ..., reason: _Optional[str] = ..., loss: _Optional[float] = ..., accuracy: _Optional[float] = ..., num_samples: _Optional[int] = ..., sums: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SiteLog(_message.Message):
    __slots__ = ("worker_id", "time_unix", "level", "logger", "message", "dropped_before")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    LOGGER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    time_unix: float
    level: str
    logger: str
    message: str
    dropped_before: int
    def __init__(self, worker_id: _Optional[str] = ..., time_unix: _Optional[float] = ..., level: _Optional[str] = ..., logger: _Optional[str] = ..., message: _Optional[str] = ..., dropped_before: _Optional[int] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "num_samples", "ish", "has_ish", "epsilon", "train_loss", "validation_loss", "tensors", "masked")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ISH_FIELD_NUMBER: _ClassVar[int]
    HAS_ISH_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_LOSS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MASKED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    num_samples: int
    ish: float
    has_ish: bool
    epsilon: float
    train_loss: float
    validation_loss: float
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    masked: bool
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., ish: _Optional[float] = ..., has_ish: _Optional[bool] = ..., epsilon: _Optional[float] = ..., train_loss: _Optional[float] = ..., validation_loss: _Optional[float] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., masked: _Optional[bool] = ...) -> None: ...

class UpdateChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class UploadReceipt(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "duplicate", "bytes_received", "sha256")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    duplicate: bool
    bytes_received: int
    sha256: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., duplicate: _Optional[bool] = ..., bytes_received: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class ModelHeader(_message.Message):
    __slots__ = ("job_id", "version", "model_spec_json", "tensors", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    model_spec_json: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    round: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ..., model_spec_json: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., round: _Optional[int] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: ModelHeader
    data: bytes
    trailer: Trailer
    def __init__(self, header: _Optional[_Union[ModelHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[Trailer, _Mapping]] = ...) -> None: ...

class GlobalModelRequest(_message.Message):
    __slots__ = ("job_id", "version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    version: int
    def __init__(self, job_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class OpenRoundRequest(_message.Message):
    __slots__ = ("job_id", "round", "participants", "deadline_unix", "aggregation_json", "seed", "histograms", "num_samples")
    class HistogramsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: LabelHistogram
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[LabelHistogram, _Mapping]] = ...) -> None: ...
    class NumSamplesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    participants: _containers.RepeatedScalarFieldContainer[str]
    deadline_unix: float
    aggregation_json: str
    seed: int
    histograms: _containers.MessageMap[str, LabelHistogram]
    num_samples: _containers.ScalarMap[str, int]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., participants: _Optional[_Iterable[str]] = ..., deadline_unix: _Optional[float] = ..., aggregation_json: _Optional[str] = ..., seed: _Optional[int] = ..., histograms: _Optional[_Mapping[str, LabelHistogram]] = ..., num_samples: _Optional[_Mapping[str, int]] = ...) -> None: ...

class LabelHistogram(_message.Message):
    __slots__ = ("counts",)
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, counts: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenRoundReply(_message.Message):
    __slots__ = ("model_version",)
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    def __init__(self, model_version: _Optional[int] = ...) -> None: ...

class RoundStatusRequest(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class RoundStatusReply(_message.Message):
    __slots__ = ("accepted", "open")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[str]
    open: bool
    def __init__(self, accepted: _Optional[_Iterable[str]] = ..., open: _Optional[bool] = ...) -> None: ...

class CloseRoundRequest(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class UpdateSummary(_message.Message):
    __slots__ = ("worker_id", "num_samples", "epsilon", "train_loss", "weight", "task")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_samples: int
    epsilon: float
    train_loss: float
    weight: float
    task: int
    def __init__(self, worker_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., epsilon: _Optional[float] = ..., train_loss: _Optional[float] = ..., weight: _Optional[float] = ..., task: _Optional[int] = ...) -> None: ...

class CloseRoundReply(_message.Message):
    __slots__ = ("model_version", "aggregated", "model_spec_json", "stats", "seconds", "updates", "verdicts", "selection", "excluded")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    aggregated: _containers.RepeatedScalarFieldContainer[str]
    model_spec_json: str
    stats: _containers.ScalarMap[str, float]
    seconds: float
    updates: _containers.RepeatedCompositeFieldContainer[UpdateSummary]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    selection: SelectionRecord
    excluded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_version: _Optional[int] = ..., aggregated: _Optional[_Iterable[str]] = ..., model_spec_json: _Optional[str] = ..., stats: _Optional[_Mapping[str, float]] = ..., seconds: _Optional[float] = ..., updates: _Optional[_Iterable[_Union[UpdateSummary, _Mapping]]] = ..., verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., selection: _Optional[_Union[SelectionRecord, _Mapping]] = ..., excluded: _Optional[_Iterable[str]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("worker_id", "rule", "kept_weight", "expected_weight", "discarded", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    KEPT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    rule: str
    kept_weight: float
    expected_weight: float
    discarded: bool
    reason: str
    def __init__(self, worker_id: _Optional[str] = ..., rule: _Optional[str] = ..., kept_weight: _Optional[float] = ..., expected_weight: _Optional[float] = ..., discarded: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class SelectionRecord(_message.Message):
    __slots__ = ("method", "accepted", "chosen", "ga_round", "ga_ran", "fallback", "fitness")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CHOSEN_FIELD_NUMBER: _ClassVar[int]
    GA_ROUND_FIELD_NUMBER: _ClassVar[int]
    GA_RAN_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    FITNESS_FIELD_NUMBER: _ClassVar[int]
    method: str
    accepted: int
    chosen: int
    ga_round: bool
    ga_ran: bool
    fallback: bool
    fitness: float
    def __init__(self, method: _Optional[str] = ..., accepted: _Optional[int] = ..., chosen: _Optional[int] = ..., ga_round: _Optional[bool] = ..., ga_ran: _Optional[bool] = ..., fallback: _Optional[bool] = ..., fitness: _Optional[float] = ...) -> None: ...

class SecAdvertiseRequest(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "cipher_key", "mask_key", "num_samples", "ish", "has_ish", "noise_variance")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CIPHER_KEY_FIELD_NUMBER: _ClassVar[int]
    MASK_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    ISH_FIELD_NUMBER: _ClassVar[int]
    HAS_ISH_FIELD_NUMBER: _ClassVar[int]
    NOISE_VARIANCE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    cipher_key: bytes
    mask_key: bytes
    num_samples: int
    ish: float
    has_ish: bool
    noise_variance: float
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., cipher_key: _Optional[bytes] = ..., mask_key: _Optional[bytes] = ..., num_samples: _Optional[int] = ..., ish: _Optional[float] = ..., has_ish: _Optional[bool] = ..., noise_variance: _Optional[float] = ...) -> None: ...

class SecParams(_message.Message):
    __slots__ = ("threshold", "neighbours", "ring_bits", "clip", "fraction_bits", "ring_dtype", "length", "n_max", "ddp_scale", "ddp_bits", "ddp_quorum", "ddp_records")
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    RING_BITS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    FRACTION_BITS_FIELD_NUMBER: _ClassVar[int]
    RING_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    N_MAX_FIELD_NUMBER: _ClassVar[int]
    DDP_SCALE_FIELD_NUMBER: _ClassVar[int]
    DDP_BITS_FIELD_NUMBER: _ClassVar[int]
    DDP_QUORUM_FIELD_NUMBER: _ClassVar[int]
    DDP_RECORDS_FIELD_NUMBER: _ClassVar[int]
    threshold: int
    neighbours: int
    ring_bits: int
    clip: float
    fraction_bits: int
    ring_dtype: str
    length: int
    n_max: int
    ddp_scale: float
    ddp_bits: int
    ddp_quorum: int
    ddp_records: int
    def __init__(self, threshold: _Optional[int] = ..., neighbours: _Optional[int] = ..., ring_bits: _Optional[int] = ..., clip: _Optional[float] = ..., fraction_bits: _Optional[int] = ..., ring_dtype: _Optional[str] = ..., length: _Optional[int] = ..., n_max: _Optional[int] = ..., ddp_scale: _Optional[float] = ..., ddp_bits: _Optional[int] = ..., ddp_quorum: _Optional[int] = ..., ddp_records: _Optional[int] = ...) -> None: ...

class SecAdvertiseReply(_message.Message):
    __slots__ = ("params", "round_seed")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ROUND_SEED_FIELD_NUMBER: _ClassVar[int]
    params: SecParams
    round_seed: bytes
    def __init__(self, params: _Optional[_Union[SecParams, _Mapping]] = ..., round_seed: _Optional[bytes] = ...) -> None: ...

class SecWaitRequest(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "wait_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    wait_s: float
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class SecPeer(_message.Message):
    __slots__ = ("worker_id", "cipher_key", "mask_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CIPHER_KEY_FIELD_NUMBER: _ClassVar[int]
    MASK_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    cipher_key: bytes
    mask_key: bytes
    def __init__(self, worker_id: _Optional[str] = ..., cipher_key: _Optional[bytes] = ..., mask_key: _Optional[bytes] = ...) -> None: ...

class SecRosterReply(_message.Message):
    __slots__ = ("ready", "peers", "scale", "roster_size")
    READY_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    ROSTER_SIZE_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    peers: _containers.RepeatedCompositeFieldContainer[SecPeer]
    scale: float
    roster_size: int
    def __init__(self, ready: _Optional[bool] = ..., peers: _Optional[_Iterable[_Union[SecPeer, _Mapping]]] = ..., scale: _Optional[float] = ..., roster_size: _Optional[int] = ...) -> None: ...

class SecCiphertext(_message.Message):
    __slots__ = ("peer", "data")
    PEER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    peer: str
    data: bytes
    def __init__(self, peer: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class SecShareRequest(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "ciphertexts")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    ciphertexts: _containers.RepeatedCompositeFieldContainer[SecCiphertext]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., ciphertexts: _Optional[_Iterable[_Union[SecCiphertext, _Mapping]]] = ...) -> None: ...

class SecShareReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SecInboxReply(_message.Message):
    __slots__ = ("ready", "ciphertexts")
    READY_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    ciphertexts: _containers.RepeatedCompositeFieldContainer[SecCiphertext]
    def __init__(self, ready: _Optional[bool] = ..., ciphertexts: _Optional[_Iterable[_Union[SecCiphertext, _Mapping]]] = ...) -> None: ...

class SecVerifyRequest(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "wait_s", "failed")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    wait_s: float
    failed: _containers.RepeatedCompositeFieldContainer[SecComplaint]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., wait_s: _Optional[float] = ..., failed: _Optional[_Iterable[_Union[SecComplaint, _Mapping]]] = ...) -> None: ...

class SecComplaint(_message.Message):
    __slots__ = ("peer", "reason")
    PEER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    peer: str
    reason: str
    def __init__(self, peer: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class SecVerifyReply(_message.Message):
    __slots__ = ("ready", "excluded")
    READY_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    excluded: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ready: _Optional[bool] = ..., excluded: _Optional[_Iterable[str]] = ...) -> None: ...

class SecSurvivorsReply(_message.Message):
    __slots__ = ("ready", "survivors", "dropped")
    READY_FIELD_NUMBER: _ClassVar[int]
    SURVIVORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    survivors: _containers.RepeatedScalarFieldContainer[str]
    dropped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ready: _Optional[bool] = ..., survivors: _Optional[_Iterable[str]] = ..., dropped: _Optional[_Iterable[str]] = ...) -> None: ...

class SecShareValue(_message.Message):
    __slots__ = ("peer", "share")
    PEER_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    peer: str
    share: bytes
    def __init__(self, peer: _Optional[str] = ..., share: _Optional[bytes] = ...) -> None: ...

class SecUnmaskRequest(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "shares")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    shares: _containers.RepeatedCompositeFieldContainer[SecShareValue]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., shares: _Optional[_Iterable[_Union[SecShareValue, _Mapping]]] = ...) -> None: ...

class SecUnmaskReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StartTaskRequest(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "version", "inline_bytes")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INLINE_BYTES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    version: int
    inline_bytes: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., version: _Optional[int] = ..., inline_bytes: _Optional[int] = ...) -> None: ...

class StartTaskReply(_message.Message):
    __slots__ = ("accepted", "open", "header", "data", "sha256")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    open: bool
    header: ModelHeader
    data: bytes
    sha256: str
    def __init__(self, accepted: _Optional[bool] = ..., open: _Optional[bool] = ..., header: _Optional[_Union[ModelHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class WholeUpdate(_message.Message):
    __slots__ = ("header", "data", "sha256")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    sha256: str
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("job_yaml", "initial_weights")
    JOB_YAML_FIELD_NUMBER: _ClassVar[int]
    INITIAL_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    job_yaml: str
    initial_weights: bytes
    def __init__(self, job_yaml: _Optional[str] = ..., initial_weights: _Optional[bytes] = ...) -> None: ...

class SubmitJobReply(_message.Message):
    __slots__ = ("job_id", "epsilon_projection", "warnings")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPSILON_PROJECTION_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    epsilon_projection: _containers.RepeatedScalarFieldContainer[str]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., epsilon_projection: _Optional[_Iterable[str]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class RoundRow(_message.Message):
    __slots__ = ("job_id", "round", "status", "participants", "aggregated", "accuracy", "loss", "seconds", "mean_train_loss", "uploaded", "model_version", "mean_staleness", "federated_accuracy", "federated_loss", "federated_samples", "evaluated_sites", "federated_metric", "federated_scores")
    class FederatedScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATED_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    FEDERATED_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    FEDERATED_LOSS_FIELD_NUMBER: _ClassVar[int]
    FEDERATED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_SITES_FIELD_NUMBER: _ClassVar[int]
    FEDERATED_METRIC_FIELD_NUMBER: _ClassVar[int]
    FEDERATED_SCORES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    status: str
    participants: int
    aggregated: int
    accuracy: float
    loss: float
    seconds: float
    mean_train_loss: float
    uploaded: int
    model_version: int
    mean_staleness: float
    federated_accuracy: float
    federated_loss: float
    federated_samples: int
    evaluated_sites: int
    federated_metric: str
    federated_scores: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., status: _Optional[str] = ..., participants: _Optional[int] = ..., aggregated: _Optional[int] = ..., accuracy: _Optional[float] = ..., loss: _Optional[float] = ..., seconds: _Optional[float] = ..., mean_train_loss: _Optional[float] = ..., uploaded: _Optional[int] = ..., model_version: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., federated_accuracy: _Optional[float] = ..., federated_loss: _Optional[float] = ..., federated_samples: _Optional[int] = ..., evaluated_sites: _Optional[int] = ..., federated_metric: _Optional[str] = ..., federated_scores: _Optional[_Mapping[str, float]] = ...) -> None: ...

class EvaluationRow(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "status", "reason", "loss", "accuracy", "num_samples", "model_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    status: str
    reason: str
    loss: float
    accuracy: float
    num_samples: int
    model_version: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., loss: _Optional[float] = ..., accuracy: _Optional[float] = ..., num_samples: _Optional[int] = ..., model_version: _Optional[int] = ...) -> None: ...

class ParticipantRow(_message.Message):
    __slots__ = ("job_id", "round", "worker_id", "status", "reason", "epsilon", "train_loss", "num_samples")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    worker_id: str
    status: str
    reason: str
    epsilon: float
    train_loss: float
    num_samples: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., epsilon: _Optional[float] = ..., train_loss: _Optional[float] = ..., num_samples: _Optional[int] = ...) -> None: ...

class WorkerRow(_message.Message):
    __slots__ = ("worker_id", "device", "epsilon_spent", "epsilon_budget", "last_seen_seconds_ago", "active")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_SPENT_FIELD_NUMBER: _ClassVar[int]
    EPSILON_BUDGET_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device: str
    epsilon_spent: float
    epsilon_budget: float
    last_seen_seconds_ago: float
    active: bool
    def __init__(self, worker_id: _Optional[str] = ..., device: _Optional[str] = ..., epsilon_spent: _Optional[float] = ..., epsilon_budget: _Optional[float] = ..., last_seen_seconds_ago: _Optional[float] = ..., active: _Optional[bool] = ...) -> None: ...

class JobRow(_message.Message):
    __slots__ = ("job_id", "status", "rounds_done", "rounds_total", "error", "submitter", "name", "category", "created_unix", "updated_unix", "spec_json", "mode", "waiting")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_DONE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SUBMITTER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: str
    rounds_done: int
    rounds_total: int
    error: str
    submitter: str
    name: str
    category: str
    created_unix: float
    updated_unix: float
    spec_json: str
    mode: str
    waiting: str
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[str] = ..., rounds_done: _Optional[int] = ..., rounds_total: _Optional[int] = ..., error: _Optional[str] = ..., submitter: _Optional[str] = ..., name: _Optional[str] = ..., category: _Optional[str] = ..., created_unix: _Optional[float] = ..., updated_unix: _Optional[float] = ..., spec_json: _Optional[str] = ..., mode: _Optional[str] = ..., waiting: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("jobs", "rounds", "workers", "participants", "evaluations")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobRow]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundRow]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerRow]
    participants: _containers.RepeatedCompositeFieldContainer[ParticipantRow]
    evaluations: _containers.RepeatedCompositeFieldContainer[EvaluationRow]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobRow, _Mapping]]] = ..., rounds: _Optional[_Iterable[_Union[RoundRow, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerRow, _Mapping]]] = ..., participants: _Optional[_Iterable[_Union[ParticipantRow, _Mapping]]] = ..., evaluations: _Optional[_Iterable[_Union[EvaluationRow, _Mapping]]] = ...) -> None: ...

class SiteRecordRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class SiteJobRow(_message.Message):
    __slots__ = ("job_id", "status", "epsilon", "rounds", "shared")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: str
    epsilon: float
    rounds: int
    shared: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[str] = ..., epsilon: _Optional[float] = ..., rounds: _Optional[int] = ..., shared: _Optional[_Iterable[str]] = ...) -> None: ...

class SiteRecordReply(_message.Message):
    __slots__ = ("worker", "jobs", "epsilon_recorded")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    EPSILON_RECORDED_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerRow
    jobs: _containers.RepeatedCompositeFieldContainer[SiteJobRow]
    epsilon_recorded: float
    def __init__(self, worker: _Optional[_Union[WorkerRow, _Mapping]] = ..., jobs: _Optional[_Iterable[_Union[SiteJobRow, _Mapping]]] = ..., epsilon_recorded: _Optional[float] = ...) -> None: ...

class ListSitesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SiteRow(_message.Message):
    __slots__ = ("worker_id", "software_version", "last_heartbeat_unix", "last_seen_seconds_ago", "active", "state", "categories", "input_shape", "num_classes", "num_samples", "device", "dp_enabled", "dp_policy", "epsilon_recorded", "first_registered_unix", "restarts", "broker_user", "last_error", "last_error_unix", "current_jobs", "past_jobs", "log_records")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SOFTWARE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DP_ENABLED_FIELD_NUMBER: _ClassVar[int]
    DP_POLICY_FIELD_NUMBER: _ClassVar[int]
    EPSILON_RECORDED_FIELD_NUMBER: _ClassVar[int]
    FIRST_REGISTERED_UNIX_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    BROKER_USER_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_UNIX_FIELD_NUMBER: _ClassVar[int]
    CURRENT_JOBS_FIELD_NUMBER: _ClassVar[int]
    PAST_JOBS_FIELD_NUMBER: _ClassVar[int]
    LOG_RECORDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    software_version: str
    last_heartbeat_unix: float
    last_seen_seconds_ago: float
    active: bool
    state: str
    categories: _containers.RepeatedScalarFieldContainer[str]
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    num_classes: int
    num_samples: int
    device: str
    dp_enabled: bool
    dp_policy: DPPolicy
    epsilon_recorded: float
    first_registered_unix: float
    restarts: int
    broker_user: str
    last_error: str
    last_error_unix: float
    current_jobs: int
    past_jobs: int
    log_records: int
    def __init__(self, worker_id: _Optional[str] = ..., software_version: _Optional[str] = ..., last_heartbeat_unix: _Optional[float] = ..., last_seen_seconds_ago: _Optional[float] = ..., active: _Optional[bool] = ..., state: _Optional[str] = ..., categories: _Optional[_Iterable[str]] = ..., input_shape: _Optional[_Iterable[int]] = ..., num_classes: _Optional[int] = ..., num_samples: _Optional[int] = ..., device: _Optional[str] = ..., dp_enabled: _Optional[bool] = ..., dp_policy: _Optional[_Union[DPPolicy, _Mapping]] = ..., epsilon_recorded: _Optional[float] = ..., first_registered_unix: _Optional[float] = ..., restarts: _Optional[int] = ..., broker_user: _Optional[str] = ..., last_error: _Optional[str] = ..., last_error_unix: _Optional[float] = ..., current_jobs: _Optional[int] = ..., past_jobs: _Optional[int] = ..., log_records: _Optional[int] = ...) -> None: ...

class ListSitesReply(_message.Message):
    __slots__ = ("sites", "heartbeat_timeout_s")
    SITES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    sites: _containers.RepeatedCompositeFieldContainer[SiteRow]
    heartbeat_timeout_s: float
    def __init__(self, sites: _Optional[_Iterable[_Union[SiteRow, _Mapping]]] = ..., heartbeat_timeout_s: _Optional[float] = ...) -> None: ...

class SiteDetailRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class SiteEventRow(_message.Message):
    __slots__ = ("seq", "time_unix", "kind", "message", "count", "first_time_unix")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    seq: int
    time_unix: float
    kind: str
    message: str
    count: int
    first_time_unix: float
    def __init__(self, seq: _Optional[int] = ..., time_unix: _Optional[float] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., count: _Optional[int] = ..., first_time_unix: _Optional[float] = ...) -> None: ...

class SiteDetailReply(_message.Message):
    __slots__ = ("site", "jobs", "events")
    SITE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    site: SiteRow
    jobs: _containers.RepeatedCompositeFieldContainer[SiteJobRow]
    events: _containers.RepeatedCompositeFieldContainer[SiteEventRow]
    def __init__(self, site: _Optional[_Union[SiteRow, _Mapping]] = ..., jobs: _Optional[_Iterable[_Union[SiteJobRow, _Mapping]]] = ..., events: _Optional[_Iterable[_Union[SiteEventRow, _Mapping]]] = ...) -> None: ...

class SiteLogsRequest(_message.Message):
    __slots__ = ("worker_id", "after", "limit")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    after: int
    limit: int
    def __init__(self, worker_id: _Optional[str] = ..., after: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class SiteLogRow(_message.Message):
    __slots__ = ("seq", "received_unix", "site_time_unix", "level", "logger", "message", "sender", "claimed", "dropped_before")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SITE_TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    LOGGER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BEFORE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    received_unix: float
    site_time_unix: float
    level: str
    logger: str
    message: str
    sender: str
    claimed: str
    dropped_before: int
    def __init__(self, seq: _Optional[int] = ..., received_unix: _Optional[float] = ..., site_time_unix: _Optional[float] = ..., level: _Optional[str] = ..., logger: _Optional[str] = ..., message: _Optional[str] = ..., sender: _Optional[str] = ..., claimed: _Optional[str] = ..., dropped_before: _Optional[int] = ...) -> None: ...

class SiteLogsReply(_message.Message):
    __slots__ = ("records",)
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[SiteLogRow]
    def __init__(self, records: _Optional[_Iterable[_Union[SiteLogRow, _Mapping]]] = ...) -> None: ...

class AbandonRoundRequest(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class AbandonRoundReply(_message.Message):
    __slots__ = ("discarded",)
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    discarded: _containers.RepeatedCompositeFieldContainer[UpdateSummary]
    def __init__(self, discarded: _Optional[_Iterable[_Union[UpdateSummary, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobReply(_message.Message):
    __slots__ = ("job_id", "status")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: str
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[str] = ...) -> None: ...

class JobEventsRequest(_message.Message):
    __slots__ = ("job_id", "after", "follow")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after: int
    follow: bool
    def __init__(self, job_id: _Optional[str] = ..., after: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("seq", "job_id", "time_unix", "kind", "round", "worker_id", "message")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    job_id: str
    time_unix: float
    kind: str
    round: int
    worker_id: str
    message: str
    def __init__(self, seq: _Optional[int] = ..., job_id: _Optional[str] = ..., time_unix: _Optional[float] = ..., kind: _Optional[str] = ..., round: _Optional[int] = ..., worker_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DownloadModelRequest(_message.Message):
    __slots__ = ("job_id", "round")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class OpenBufferRequest(_message.Message):
    __slots__ = ("job_id", "aggregation_json", "buffer_size", "max_staleness", "staleness", "staleness_params_json", "server_lr", "seed", "num_samples")
    class NumSamplesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_JSON_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    SERVER_LR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    aggregation_json: str
    buffer_size: int
    max_staleness: int
    staleness: str
    staleness_params_json: str
    server_lr: float
    seed: int
    num_samples: _containers.ScalarMap[str, int]
    def __init__(self, job_id: _Optional[str] = ..., aggregation_json: _Optional[str] = ..., buffer_size: _Optional[int] = ..., max_staleness: _Optional[int] = ..., staleness: _Optional[str] = ..., staleness_params_json: _Optional[str] = ..., server_lr: _Optional[float] = ..., seed: _Optional[int] = ..., num_samples: _Optional[_Mapping[str, int]] = ...) -> None: ...

class OpenBufferReply(_message.Message):
    __slots__ = ("model_version",)
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    def __init__(self, model_version: _Optional[int] = ...) -> None: ...

class IssueTasksRequest(_message.Message):
    __slots__ = ("job_id", "workers", "num_samples")
    class NumSamplesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    workers: _containers.RepeatedScalarFieldContainer[str]
    num_samples: _containers.ScalarMap[str, int]
    def __init__(self, job_id: _Optional[str] = ..., workers: _Optional[_Iterable[str]] = ..., num_samples: _Optional[_Mapping[str, int]] = ...) -> None: ...

class IssuedTask(_message.Message):
    __slots__ = ("worker_id", "task", "base_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    task: int
    base_version: int
    def __init__(self, worker_id: _Optional[str] = ..., task: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class IssueTasksReply(_message.Message):
    __slots__ = ("tasks",)
    TASKS_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[IssuedTask]
    def __init__(self, tasks: _Optional[_Iterable[_Union[IssuedTask, _Mapping]]] = ...) -> None: ...

class VersionRow(_message.Message):
    __slots__ = ("version", "updates", "staleness", "created_unix")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    version: int
    updates: _containers.RepeatedCompositeFieldContainer[UpdateSummary]
    staleness: _containers.RepeatedScalarFieldContainer[int]
    created_unix: float
    def __init__(self, version: _Optional[int] = ..., updates: _Optional[_Iterable[_Union[UpdateSummary, _Mapping]]] = ..., staleness: _Optional[_Iterable[int]] = ..., created_unix: _Optional[float] = ...) -> None: ...

class BufferStatusRequest(_message.Message):
    __slots__ = ("job_id", "since_version")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    since_version: int
    def __init__(self, job_id: _Optional[str] = ..., since_version: _Optional[int] = ...) -> None: ...

class BufferStatusReply(_message.Message):
    __slots__ = ("model_version", "buffered", "buffer_size", "outstanding", "versions", "refused_stale")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SIZE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_STALE_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    buffered: int
    buffer_size: int
    outstanding: _containers.RepeatedCompositeFieldContainer[IssuedTask]
    versions: _containers.RepeatedCompositeFieldContainer[VersionRow]
    refused_stale: int
    def __init__(self, model_version: _Optional[int] = ..., buffered: _Optional[int] = ..., buffer_size: _Optional[int] = ..., outstanding: _Optional[_Iterable[_Union[IssuedTask, _Mapping]]] = ..., versions: _Optional[_Iterable[_Union[VersionRow, _Mapping]]] = ..., refused_stale: _Optional[int] = ...) -> None: ...

class CloseBufferRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CloseBufferReply(_message.Message):
    __slots__ = ("model_version", "discarded")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    discarded: _containers.RepeatedCompositeFieldContainer[UpdateSummary]
    def __init__(self, model_version: _Optional[int] = ..., discarded: _Optional[_Iterable[_Union[UpdateSummary, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobSnapshot(_message.Message):
    __slots__ = ("job_id", "round", "accepted", "open", "model_version", "buffered")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    accepted: int
    open: bool
    model_version: int
    buffered: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., accepted: _Optional[int] = ..., open: _Optional[bool] = ..., model_version: _Optional[int] = ..., buffered: _Optional[int] = ...) -> None: ...

class JobChanges(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobSnapshot]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobSnapshot, _Mapping]]] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("worker_id", "state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    state: str
    def __init__(self, worker_id: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class KeepAliveReply(_message.Message):
    __slots__ = ("next_in_ms", "workers_present")
    NEXT_IN_MS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PRESENT_FIELD_NUMBER: _ClassVar[int]
    next_in_ms: int
    workers_present: int
    def __init__(self, next_in_ms: _Optional[int] = ..., workers_present: _Optional[int] = ...) -> None: ...
