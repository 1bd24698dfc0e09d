"""One validated settings object, read from a TOML file and `WORKER_<SECTION>_<FIELD>` environment variables.

This is the only place defaults live. `load_settings` either returns a complete, valid `Settings` or raises
`ConfigError` naming every bad field, so the worker never starts half-configured.

- `fields`: `setting(...)`, a field with its reference entry (description, range, hint, unit), and `ConfigError`.
- `sections`, `batching`, `model`: the sections, one frozen dataclass each, every field declared with `setting`.
- `settings`: `Settings`, one field per section.  `load`: file < env < overrides.  `validate`: the checks.
- `derived`: what settings resolve to at start-up (preprocessing threads, the in-flight limit, warm-up shapes).
- `docs`: `python -m worker.config.docs` writes docs/configuration.md's tables and the JSON Schema from the fields.

Adding a setting is one declaration in its section's dataclass, as `LimitsSettings.duplicate_window_frames` is:

    duplicate_window_frames: int = setting(4096, ge=0, le=1_000_000, unit="frames", hint="0 = off", doc=(
        "what it does and when to change it, as the docs' meaning column says it"))

then `python -m worker.config.docs` (and commit docs/ and schemas/). The loader converts the file's and the
environment's values by the type; `validate` enforces ge/gt/le/lt by itself, its problem naming the setting, the
bounds and the `hint` (which the docs' range column shows too). A check that needs another field goes in
`validate.validate` (a problem starting `section.field:`, which replaces the generic one). A new section: a frozen
dataclass (its own module when large), a `Settings` field `name: NewSettings = setting(default_factory=NewSettings,
doc="...")`, and a `<!-- reference:name (...) -->` ... `<!-- /reference:name -->` pair in docs/configuration.md
where its table goes.
"""
from worker.config.batching import BatchingSettings, ClassSettings
from worker.config.derived import (
    inflight_batch_limit,
    parse_size,
    preprocess_thread_count,
    resolve_inflight_batches,
    usable_cores,
    warmup_frame_shapes,
)
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
from worker.config.model import (
    MAX_INSTANCES_PER_DEVICE,
    MAX_PREPROCESS_THREADS,
    MODEL_PRESETS,
    ModelSettings,
    RuntimeSettings,
)
from worker.config.policy import PolicySettings, model_label_thresholds, policy_problems
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
    validate,
    validate_schema_registry,
    validate_security,
)

__all__ = [
    "ENV_PREFIX", "GROUP_INSTANCE_ID_RE", "MAX_FRAME_PIXELS_CEILING", "MAX_INFLIGHT_BATCHES",
    "MAX_INFLIGHT_PER_RUNNER", "MAX_INSTANCES_PER_DEVICE", "MAX_METRIC_TENANTS", "MAX_PREPROCESS_THREADS",
    "MAX_WORKER_SLOTS", "MODEL_PRESETS",
    "RETIRED_SETTINGS", "SASL_MECHANISMS", "SECTIONS", "SECURITY_PROTOCOLS", "BatchingSettings", "ClassSettings",
    "ConfigError", "DeadLetterSettings", "DeliveryMode", "DeliverySettings", "FieldDoc", "KafkaSettings",
    "LimitsSettings", "LogFormat", "LogLevel", "ModelSettings", "ObservabilitySettings", "PolicySettings", "Precision",
    "RuntimeSettings", "SchemaRegistrySettings", "Settings", "TopicSettings", "TracingSettings", "field_doc",
    "group_instance_id_problem", "inflight_batch_limit", "load_settings", "model_label_thresholds", "parse_size",
    "policy_problems", "preprocess_thread_count",
    "resolve_inflight_batches", "setting", "usable_cores", "validate", "validate_schema_registry", "validate_security",
    "warmup_frame_shapes",
]
