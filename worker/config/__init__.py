"""One validated settings object, read from a TOML file and `WORKER_<SECTION>_<FIELD>` environment variables.

This is the only place defaults live. `load_settings` either returns a complete, valid `Settings` or raises
`ConfigError` naming every bad field, so the worker never starts half-configured.

- `fields`: `setting(...)`, a field with its reference entry (description, range, unit), and `ConfigError`.
- `sections`, `batching`, `model`: the sections, one dataclass each, every field declared with `setting`.
- `settings`: `Settings`, one field per section.  `load`: file < env < overrides.  `validate`: the checks.
- `docs`: `python -m worker.config.docs` writes docs/configuration.md's tables and the JSON Schema from the fields.
"""

from worker.config.batching import BatchingSettings, ClassSettings
from worker.config.fields import (
    ENV_PREFIX,
    ConfigError,
    DeliveryMode,
    FieldDoc,
    LogFormat,
    LogLevel,
    Precision,
    field_doc,
    setting,
)
from worker.config.load import RETIRED_SETTINGS, load_settings
from worker.config.model import MAX_PREPROCESS_THREADS, MODEL_PRESETS, ModelSettings, RuntimeSettings
from worker.config.sections import (
    MAX_FRAME_PIXELS_CEILING,
    MAX_INFLIGHT_BATCHES,
    MAX_INFLIGHT_PER_RUNNER,
    MAX_METRIC_TENANTS,
    MAX_WORKER_SLOTS,
    DeadLetterSettings,
    DeliverySettings,
    KafkaSettings,
    LimitsSettings,
    ObservabilitySettings,
    TopicSettings,
)
from worker.config.settings import SECTIONS, Settings
from worker.config.validate import (
    GROUP_INSTANCE_ID_RE,
    SASL_MECHANISMS,
    SECURITY_PROTOCOLS,
    group_instance_id_problem,
    inflight_batch_limit,
    preprocess_thread_count,
    resolve_inflight_batches,
    validate,
    validate_security,
    warmup_frame_shapes,
)

__all__ = [
    "ENV_PREFIX", "GROUP_INSTANCE_ID_RE", "MAX_FRAME_PIXELS_CEILING", "MAX_INFLIGHT_BATCHES", "MAX_INFLIGHT_PER_RUNNER",
    "MAX_METRIC_TENANTS", "MAX_PREPROCESS_THREADS", "MAX_WORKER_SLOTS", "MODEL_PRESETS", "RETIRED_SETTINGS",
    "SASL_MECHANISMS", "SECTIONS", "SECURITY_PROTOCOLS", "BatchingSettings", "ClassSettings", "ConfigError",
    "DeadLetterSettings", "DeliveryMode", "DeliverySettings", "FieldDoc", "KafkaSettings", "LimitsSettings",
    "LogFormat", "LogLevel", "ModelSettings", "ObservabilitySettings", "Precision", "RuntimeSettings", "Settings",
    "TopicSettings", "field_doc", "group_instance_id_problem", "inflight_batch_limit", "load_settings",
    "preprocess_thread_count", "resolve_inflight_batches", "setting", "validate", "validate_security",
    "warmup_frame_shapes",
]
