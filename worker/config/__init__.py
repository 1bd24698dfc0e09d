"""One validated settings object, read from a TOML file and `WORKER_<SECTION>_<FIELD>` environment variables.

This is the only place defaults live. `load_settings` either returns a complete, valid `Settings` or raises
`ConfigError` naming every bad field, so the worker never starts half-configured.

- `fields`: `setting(...)`, a field with its reference entry (description, range, unit), and `ConfigError`.
- `sections`, `batching`, `model`: the sections, one frozen dataclass each, every field declared with `setting`.
- `settings`: `Settings`, one field per section.  `load`: file < env < overrides.  `validate`: the checks.
- `docs`: `python -m worker.config.docs` writes docs/configuration.md's tables and the JSON Schema from the fields.

Adding a setting is one declaration in its section's dataclass, e.g. in `BatchingSettings`:

    max_linger_ms: float = setting(50.0, ge=0, le=10_000, unit="ms", doc=(
        "what it does and when to change it, as the docs' meaning column says it"))

then `python -m worker.config.docs` (and commit docs/ and schemas/). The loader converts the file's and the
environment's values by the type; `validate` enforces ge/gt/le/lt by itself. A check that needs another field
or a message with a hint goes in `validate.validate` (its problem, starting `section.field:`, replaces the
generic one). A new section: a frozen dataclass (its own module when large), a `Settings` field
`name: NewSettings = setting(default_factory=NewSettings, doc="...")`, and a
`<!-- reference:name (...) -->` ... `<!-- /reference:name -->` pair in docs/configuration.md where its table goes.
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
    SchemaRegistrySettings,
    TopicSettings,
    TracingSettings,
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
    validate_schema_registry,
    validate_security,
    warmup_frame_shapes,
)

__all__ = [
    "ENV_PREFIX", "GROUP_INSTANCE_ID_RE", "MAX_FRAME_PIXELS_CEILING", "MAX_INFLIGHT_BATCHES",
    "MAX_INFLIGHT_PER_RUNNER", "MAX_METRIC_TENANTS", "MAX_PREPROCESS_THREADS", "MAX_WORKER_SLOTS", "MODEL_PRESETS",
    "RETIRED_SETTINGS", "SASL_MECHANISMS", "SECTIONS", "SECURITY_PROTOCOLS", "BatchingSettings", "ClassSettings",
    "ConfigError", "DeadLetterSettings", "DeliveryMode", "DeliverySettings", "FieldDoc", "KafkaSettings",
    "LimitsSettings", "LogFormat", "LogLevel", "ModelSettings", "ObservabilitySettings", "Precision",
    "RuntimeSettings", "SchemaRegistrySettings", "Settings", "TopicSettings", "TracingSettings", "field_doc",
    "group_instance_id_problem", "inflight_batch_limit", "load_settings", "preprocess_thread_count",
    "resolve_inflight_batches", "setting", "validate", "validate_schema_registry", "validate_security",
    "warmup_frame_shapes",
]
