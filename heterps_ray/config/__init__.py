"""Job, cluster and model configs: YAML files validated on load.

Every validation failure becomes one :class:`~heterps_ray.errors.ConfigError` naming the file,
the field (dotted path) and what was expected. Relative paths inside a config are resolved
against the directory of the file that names them, so a job can be run from anywhere.

Example::

    job = load_job("configs/jobs/quickstart.yaml")
    job.cluster.resource_types[0].name   # "cpu_small"

The models live in config/cluster.py (the resource types) and config/job.py (the job and its parts);
reading and validating files in config/files.py. Everything is imported from here.
"""

from heterps_ray.config.cluster import (
    ACTIVE_SPIN_COUNT,
    ACTOR_RESERVE_GB,
    DRIVER_GB,
    OBJECT_STORE_GB,
    AutoscaleConfig,
    ClusterConfig,
    PSConfig,
    ResourceType,
    machine_memory_gb,
)
from heterps_ray.config.files import (
    load_cluster,
    load_job,
    load_model,
    read_text,
    read_yaml,
    validate,
    writable,
)
from heterps_ray.config.job import (
    DataConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    RuntimeConfig,
    TableConfig,
)

__all__ = [
    "ACTIVE_SPIN_COUNT",
    "ACTOR_RESERVE_GB",
    "DRIVER_GB",
    "OBJECT_STORE_GB",
    "AutoscaleConfig",
    "ClusterConfig",
    "DataConfig",
    "JobConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PSConfig",
    "ResourceType",
    "RuntimeConfig",
    "TableConfig",
    "load_cluster",
    "load_job",
    "load_model",
    "machine_memory_gb",
    "read_text",
    "read_yaml",
    "validate",
    "writable",
]
