"""Baseline schedulers: single-type, greedy, genetic and random search.

They search over assignments only; every assignment they try is provisioned exactly by the shared
`provision_counts`, so they differ from `exact` only in which assignments they look at.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np

from heterps_ray.costmodel import CostModel, Problem
from heterps_ray.costmodel.plan import Plan
from heterps_ray.errors import ConfigError
from heterps_ray.scheduling.base import Scheduler, register_scheduler
from heterps_ray.scheduling.provisioning import Provisioned, plan_from_counts, provision_counts

Assignment = tuple[int, ...]


class _Pricer:
    """Provisions assignments once each, remembers the best. Feasible plans rank by cost;
    infeasible ones after them, by the highest throughput they reach."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.model = CostModel(problem)
        self.seen: dict[Assignment, Provisioned] = {}
        self.best: tuple[Assignment, Provisioned] | None = None
        self.started = time.perf_counter()

    @staticmethod
    def score(counts: Provisioned) -> tuple[int, float]:
        return (0, counts.cost) if counts.feasible else (1, -counts.max_throughput)

    def price(self, assignment: Iterable[int]) -> tuple[int, float]:
        key = tuple(int(t) for t in assignment)
        counts = self.seen.get(key)
        if counts is None:
            counts = provision_counts(self.model, key)
            self.seen[key] = counts
            if self.best is None or self.score(counts) < self.score(self.best[1]):
                self.best = (key, counts)
        return self.score(counts)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def plan(self, scheduler: str, extra: dict | None = None) -> Plan:
        assert self.best is not None, "no assignment was priced"
        assignment, counts = self.best
        best_throughput = max(c.max_throughput for c in self.seen.values())
        return plan_from_counts(
            self.problem,
            self.model,
            assignment,
            counts,
            scheduler=scheduler,
            seconds=self.elapsed(),
            plans_evaluated=len(self.seen),
            best_throughput=best_throughput,
            extra=extra,
        )


def _random_assignment(rng: np.random.Generator, runnable: np.ndarray) -> Assignment:
    """Per layer a runnable type; keeps the previous layer's type with a per-plan probability, so
    plans of few long stages are as likely as fragmented ones."""
    stick = rng.random()
    out: list[int] = []
    for li in range(runnable.shape[0]):
        options = np.flatnonzero(runnable[li])
        if out and runnable[li, out[-1]] and rng.random() < stick:
            out.append(out[-1])
        else:
            out.append(int(rng.choice(options)))
    return tuple(out)


# ---------------------------------------------------------------------------------------------


@register_scheduler("single")
class SingleTypeScheduler(Scheduler):
    """Every layer on one type: what a user without HeterPS does. `type_name=None` takes the best
    of all types that can run every layer."""

    def __init__(self, type_name: str | None = None, seed: int = 0, budget_s: float | None = None):
        self.type_name = type_name
        self.name = f"single:{type_name}" if type_name else "single"

    def schedule(self, problem: Problem) -> Plan:
        candidates = problem.types_running_all_layers()
        if self.type_name is not None:
            if self.type_name not in candidates:
                raise ConfigError(
                    None,
                    "scheduler",
                    f"single:<type> with a type that can run every layer of {problem.name!r} (those are {candidates})",
                    f"single:{self.type_name}",
                )
            candidates = [self.type_name]
        if not candidates:
            raise ConfigError(
                None,
                "scheduler",
                f"a problem where one type can run every layer ({problem.name!r} has none)",
                "single",
            )
        pricer = _Pricer(problem)
        for name in candidates:
            pricer.price([problem.type_index(name)] * problem.num_layers)
        return pricer.plan(self.name)


@register_scheduler("greedy")
class GreedyScheduler(Scheduler):
    """Start from the best of: each layer on its cheapest type (price x time), each layer on its
    fastest type, every single-type plan; then steepest descent over moves that re-type one layer
    or one whole stage, until no move lowers the cost."""

    name = "greedy"

    def __init__(self, seed: int = 0, budget_s: float | None = None):
        self.budget_s = budget_s

    def schedule(self, problem: Problem) -> Plan:
        pricer = _Pricer(problem)
        model = pricer.model
        dollar_ms = np.where(model.runnable, model.compute_ms * model.price[None, :], np.inf)
        # per layer: least $ per batch, ties to the faster type
        order = np.lexsort((model.compute_ms, dollar_ms), axis=1)
        cheapest = tuple(int(t) for t in order[:, 0])
        fastest = tuple(int(t) for t in np.argmin(model.compute_ms, axis=1))
        singles = [(t,) * model.num_layers for t in range(model.num_types) if model.runnable[:, t].all()]
        score, current = min((pricer.price(a), a) for a in [cheapest, fastest, *singles])
        while self.budget_s is None or pricer.elapsed() < self.budget_s:
            moves = [(pricer.price(a), a) for a in self._neighbours(current, model)]
            if not moves:
                break
            best_score, best = min(moves)
            if best_score >= score:
                break
            current, score = best, best_score
        return pricer.plan(self.name)

    @staticmethod
    def _neighbours(current: Assignment, model: CostModel) -> list[Assignment]:
        out: list[Assignment] = []
        for li in range(len(current)):
            for t in np.flatnonzero(model.runnable[li]).tolist():
                if t != current[li]:
                    out.append(current[:li] + (t,) + current[li + 1 :])
        for start, end, t_old in model.split_stages(current):
            for t in range(model.num_types):
                if t != t_old and model.runnable[start:end, t].all():
                    out.append(current[:start] + (t,) * (end - start) + current[end:])
        return out


@register_scheduler("genetic")
class GeneticScheduler(Scheduler):
    """A genetic algorithm over assignments: tournament selection, one-point crossover, per-gene
    and whole-stage mutation, elitism. Seeded; stops after `generations` or `budget_s`."""

    name = "genetic"

    def __init__(
        self,
        seed: int = 0,
        budget_s: float | None = None,
        population: int = 48,
        generations: int = 60,
        mutation_rate: float | None = None,
        elite: int = 2,
    ):
        self.seed, self.budget_s = seed, budget_s
        self.population, self.generations, self.elite = population, generations, elite
        self.mutation_rate = mutation_rate

    def schedule(self, problem: Problem) -> Plan:
        rng = np.random.default_rng(self.seed)
        pricer = _Pricer(problem)
        runnable = pricer.model.runnable
        L = problem.num_layers
        rate = self.mutation_rate if self.mutation_rate is not None else 1.0 / L
        singles = [(problem.type_index(n),) * L for n in problem.types_running_all_layers()]
        pop = singles[: self.population // 4]
        pop += [_random_assignment(rng, runnable) for _ in range(self.population - len(pop))]
        generations_run = 0
        for _ in range(self.generations):
            scores = [pricer.price(a) for a in pop]
            generations_run += 1
            if self.budget_s is not None and pricer.elapsed() >= self.budget_s:
                break
            ranked = [pop[i] for i in sorted(range(len(pop)), key=lambda i: scores[i])]
            rank_of = {a: r for r, a in reversed(list(enumerate(ranked)))}
            children = ranked[: self.elite]
            while len(children) < self.population:
                mother = self._tournament(rng, pop, rank_of)
                father = self._tournament(rng, pop, rank_of)
                children.append(
                    self._mutate(rng, self._crossover(rng, mother, father, runnable), runnable, rate)
                )
            pop = children
        return pricer.plan(self.name, extra={"generations": generations_run, "seed": self.seed})

    @staticmethod
    def _tournament(rng: np.random.Generator, pop: Sequence[Assignment], rank_of: dict) -> Assignment:
        picks = rng.integers(0, len(pop), size=3)
        return min((pop[i] for i in picks), key=lambda a: rank_of[a])

    @staticmethod
    def _crossover(
        rng: np.random.Generator, a: Assignment, b: Assignment, runnable: np.ndarray
    ) -> Assignment:
        if len(a) < 2:
            return a
        cut = int(rng.integers(1, len(a)))
        return a[:cut] + b[cut:]  # both parents are runnable per layer, so the child is too

    @staticmethod
    def _mutate(rng: np.random.Generator, a: Assignment, runnable: np.ndarray, rate: float) -> Assignment:
        genes = list(a)
        for li in range(len(genes)):
            if rng.random() < rate:
                genes[li] = int(rng.choice(np.flatnonzero(runnable[li])))
        if rng.random() < 0.2:  # re-type a run of layers at once, so stages can move as a whole
            start = int(rng.integers(0, len(genes)))
            end = int(rng.integers(start + 1, len(genes) + 1))
            options = np.flatnonzero(runnable[start:end].all(axis=0))
            if len(options):
                genes[start:end] = [int(rng.choice(options))] * (end - start)
        return tuple(genes)


@register_scheduler("random")
class RandomSearchScheduler(Scheduler):
    """Random assignments (each provisioned exactly); the best of `samples` or of `budget_s`."""

    name = "random"

    def __init__(self, seed: int = 0, budget_s: float | None = None, samples: int = 2000):
        self.seed, self.budget_s, self.samples = seed, budget_s, samples

    def schedule(self, problem: Problem) -> Plan:
        rng = np.random.default_rng(self.seed)
        pricer = _Pricer(problem)
        for _ in range(self.samples):
            pricer.price(_random_assignment(rng, pricer.model.runnable))
            if self.budget_s is not None and pricer.elapsed() >= self.budget_s:
                break
        return pricer.plan(self.name, extra={"seed": self.seed})
