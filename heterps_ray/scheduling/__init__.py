"""heterps_ray.scheduling — plans, exact provisioning and the schedulers behind one interface.

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
from heterps_ray.scheduling.plan import Plan, PlanStage, check_plan, load_plan
from heterps_ray.scheduling.provisioning import Provisioned, plan_from_counts, provision, provision_counts

__all__ = [
    "BaseModelScheduler",
    "Plan",
    "PlanStage",
    "Provisioned",
    "Scheduler",
    "available_schedulers",
    "base_model",
    "check_plan",
    "get_scheduler",
    "load_plan",
    "plan_from_counts",
    "provision",
    "provision_counts",
    "register_scheduler",
]
