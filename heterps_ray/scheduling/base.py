"""The scheduler interface and its registry.

Every scheduler is a small class with `schedule(problem) -> Plan`. Factories are registered by
name and must accept the keyword arguments `seed` and `budget_s` (they may ignore them)::

    @register_scheduler("mine")
    class Mine(Scheduler):
        def __init__(self, seed: int = 0, budget_s: float | None = None): ...

    plan = get_scheduler("mine", seed=1).schedule(problem)

`single:<type>` names the single-type baseline for that type; `base:<name>` runs scheduler `<name>` on
the base model of DESIGN.md §3 (the problem without its `runtime` section) and prices its plan as the
problem describes the runtime (§3b): what ignoring the runtime terms costs. The RL scheduler lives in
heterps_ray.scheduling.rl and registers itself as "rl" when imported; `get_scheduler("rl")`
imports it.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.costmodel.plan import Plan
from heterps_ray.errors import ConfigError

# Modules whose import registers schedulers; the optional ones may be absent from a build.
_BUILTIN_MODULES = ("heterps_ray.scheduling.baselines", "heterps_ray.scheduling.exact")
_OPTIONAL_MODULES = {"rl": "heterps_ray.scheduling.rl"}

_REGISTRY: dict[str, Callable[..., Scheduler]] = {}

F = TypeVar("F", bound=Callable[..., Any])


class Scheduler(ABC):
    """Problem -> plan. `name` is what the plan's `scheduler` field says."""

    name: str = "scheduler"

    @abstractmethod
    def schedule(self, problem: Problem) -> Plan:
        """Return the best plan found. Does not change `problem`. An infeasible problem gives a
        plan with `feasible=False` (the CLI turns it into exit code 3)."""


def register_scheduler(name: str) -> Callable[[F], F]:
    """Class or factory decorator: make `get_scheduler(name, **kw)` call it with `**kw`."""

    def decorate(factory: F) -> F:
        _REGISTRY[name] = factory
        return factory

    return decorate


def get_scheduler(name: str, **kwargs: Any) -> Scheduler:
    """A scheduler by name: rl, exact, brute, greedy, genetic, random, single (the best
    single-type plan), single:<type>, or base:<name> (that scheduler on the base model).

    `kwargs` (typically seed, budget_s) go to its factory.
    """
    _import_builtins()
    for option in ("budget_s", "finetune_s"):
        _check_seconds(option, kwargs.get(option))
    if name.startswith("base:"):
        return BaseModelScheduler(get_scheduler(name.removeprefix("base:"), **kwargs))
    if name.startswith("single:"):
        return _REGISTRY["single"](type_name=name.split(":", 1)[1], **kwargs)
    if name not in _REGISTRY and name in _OPTIONAL_MODULES:
        importlib.import_module(_OPTIONAL_MODULES[name])
    if name not in _REGISTRY:
        known = sorted(set(_REGISTRY) | set(_OPTIONAL_MODULES))
        raise ConfigError(None, "scheduler", f"one of {known}, single:<type> or base:<name>", name)
    return _REGISTRY[name](**kwargs)


def base_model(problem: Problem) -> Problem:
    """`problem` priced by the base model of DESIGN.md §3: without its runtime section (§3b)."""
    return problem.model_copy(update={"runtime": None})


class BaseModelScheduler(Scheduler):
    """`inner` schedules the base model of `problem` (base_model); the plan it returns is priced by
    `problem`'s own model, with `extra` keeping what the base model promised (base_throughput,
    base_cost). On a problem without runtime terms it is `inner` itself."""

    def __init__(self, inner: Scheduler):
        if isinstance(inner, BaseModelScheduler):
            raise ConfigError(None, "scheduler", "base:<name> with one base: prefix", f"base:{inner.name}")
        self.inner = inner
        self.name = f"base:{inner.name}"

    def schedule(self, problem: Problem) -> Plan:
        planned = self.inner.schedule(base_model(problem))
        evaluation = CostModel(problem).evaluate(
            list(planned.assignment), planned.replicas, planned.ps_shards
        )
        return Plan.from_evaluation(
            problem,
            evaluation,
            self.name,
            seconds=planned.seconds,
            plans_evaluated=planned.plans_evaluated,
            extra={
                **planned.extra,
                "base_throughput": planned.throughput if math.isfinite(planned.throughput) else None,
                "base_cost": planned.cost if math.isfinite(planned.cost) else None,
            },
        )


def _check_seconds(field: str, value: Any) -> None:
    """A time budget is a positive, finite number of seconds (or None: the scheduler's default)."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigError(None, field, "a positive, finite number of seconds", value)


def available_schedulers() -> list[str]:
    """Registered names (importing the optional RL scheduler if it is installed)."""
    _import_builtins()
    for name, module in _OPTIONAL_MODULES.items():
        if name not in _REGISTRY:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name is None or not module.startswith(exc.name):
                    raise
    return sorted(_REGISTRY)


def _import_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
