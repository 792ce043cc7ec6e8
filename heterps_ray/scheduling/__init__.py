"""heterps_ray.scheduling — exact provisioning and the schedulers behind one interface (the Plan they
return lives in heterps_ray.costmodel, below them).

from heterps_ray.scheduling import get_scheduler
plan = get_scheduler("exact").schedule(problem)
print(plan.table())
"""

from heterps_ray.scheduling.base import (
    BaseModelScheduler,
    Scheduler,
    available_schedulers,
    base_model,
    get_scheduler,
    register_scheduler,
)
from heterps_ray.scheduling.provisioning import Provisioned, plan_from_counts, provision, provision_counts

__all__ = [
    "BaseModelScheduler",
    "Provisioned",
    "Scheduler",
    "available_schedulers",
    "base_model",
    "get_scheduler",
    "plan_from_counts",
    "provision",
    "provision_counts",
    "register_scheduler",
]
