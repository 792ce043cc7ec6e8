"""The RL scheduling environment: masks, fixed-size feature observations, rewards that order plans."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from heterps_ray.costmodel import CostModel, problem_from_dict
from heterps_ray.scheduling.generator import generate_problem
from heterps_ray.scheduling.provisioning import provision_counts
from heterps_ray.scheduling.rl.env import (
    CONTEXT_FEATURES,
    PRETRAIN_TYPES,
    REWARD_CLIP,
    TYPE_FEATURES,
    ProblemView,
    SchedulingEnv,
)


def _play(env: SchedulingEnv, choose) -> tuple[list[int], float, list[dict]]:
    obs, _ = env.reset(seed=0)
    observations, actions, reward, done = [obs], [], 0.0, False
    while not done:
        action = choose(obs)
        obs, reward, done, truncated, _ = env.step(action)
        assert not truncated
        actions.append(action)
        observations.append(obs)
    return actions, reward, observations


def _tiny_problem(floor: float = 1000.0):
    """Two layers; the GPU cannot run the embedding. B = 100, so the floor's budget is 100 ms per batch."""
    return problem_from_dict(
        {
            "name": "tiny",
            "batch_size": 100,
            "samples": 1.0e6,
            "throughput_min": floor,
            "resources": [
                {"name": "cpu", "price_per_hour": 1.0, "max_instances": 8, "bandwidth_gbps": 10},
                {"name": "gpu", "price_per_hour": 4.0, "max_instances": 2, "bandwidth_gbps": 10},
            ],
            "layers": [
                {
                    "name": "emb",
                    "out_bytes_per_sample": 400,
                    "time_ms": {"cpu": {"fixed": 0, "per_sample": 0.5}},
                },
                {
                    "name": "fc",
                    "out_bytes_per_sample": 4,
                    "time_ms": {
                        "cpu": {"fixed": 0, "per_sample": 3.0},
                        "gpu": {"fixed": 0, "per_sample": 0.05},
                    },
                },
            ],
        }
    )


def test_masks_follow_which_types_can_run_each_layer():
    problem = generate_problem(11, num_layers=(12, 12), num_types=(4, 4))
    model = CostModel(problem)
    env = SchedulingEnv({"problem": problem})
    rng = np.random.default_rng(0)
    for _ in range(20):
        actions, _, observations = _play(env, lambda obs: int(rng.choice(np.flatnonzero(obs["action_mask"]))))
        for layer, (obs, action) in enumerate(zip(observations, actions, strict=False)):
            expected = model.runnable[layer]  # one problem: the type axis is exactly its types
            np.testing.assert_array_equal(obs["action_mask"], expected)
            assert model.runnable[layer, action]


def test_masked_action_is_refused():
    env = SchedulingEnv({"problem": _tiny_problem()})
    env.reset(seed=0)
    with pytest.raises(ValueError, match="masked"):
        env.step(1)  # the GPU cannot run the embedding layer
    padded = SchedulingEnv({"problem": _tiny_problem(), "pad_types": PRETRAIN_TYPES})
    padded.reset(seed=0)
    with pytest.raises(ValueError, match="masked"):
        padded.step(4)  # padding: the problem has two types


@pytest.mark.parametrize(("layers", "types"), [(3, 2), (30, 5), (7, 3), (90, 8)])
def test_observation_has_one_shape_for_every_problem_size(layers, types):
    problem = generate_problem(5, num_layers=(layers, layers), num_types=(types, types), catalogue="wide")
    env = SchedulingEnv({"problem": problem, "pad_types": PRETRAIN_TYPES})
    actions, _, observations = _play(env, lambda obs: int(np.flatnonzero(obs["action_mask"])[0]))
    assert len(actions) == layers
    for obs in observations:
        assert env.observation_space.contains(obs)
        assert obs["type_features"].shape == (PRETRAIN_TYPES, len(TYPE_FEATURES))
        assert obs["context"].shape == (len(CONTEXT_FEATURES),)
        np.testing.assert_array_equal(obs["type_present"], [1.0] * types + [0.0] * (PRETRAIN_TYPES - types))
        assert not obs["type_features"][types:].any()  # padded types carry no features
        assert obs["action_mask"][types:].sum() == 0


def test_episode_is_priced_by_exact_provisioning():
    problem = generate_problem(3, num_layers=(6, 6), num_types=(3, 3))
    env = SchedulingEnv({"problem": problem})
    rng = np.random.default_rng(1)
    actions, reward, _ = _play(env, lambda obs: int(rng.choice(np.flatnonzero(obs["action_mask"]))))
    expected = provision_counts(CostModel(problem), actions)
    assert env.last_result is not None
    assert env.last_result.assignment == tuple(actions)
    assert env.last_result.provisioned == expected
    assert reward == env.last_result.reward


def test_rewards_order_every_plan_of_a_small_problem_by_cost():
    for seed in range(20, 60):  # the first generated problem with both feasible and infeasible plans
        problem = generate_problem(seed, num_layers=(5, 5), num_types=(3, 3))
        view = ProblemView(problem)
        choices = [np.flatnonzero(view.model.runnable[layer]).tolist() for layer in range(problem.num_layers)]
        results = [view.record(a) for a in itertools.product(*choices)]
        feasible = sorted((r for r in results if r.feasible), key=lambda r: r.provisioned.cost)
        infeasible = [r for r in results if not r.feasible]
        if len(feasible) > 1 and infeasible:
            break
    assert len(feasible) > 1 and infeasible, "no generated problem with feasible and infeasible plans"
    rewards = [r.reward for r in feasible]
    assert all(a >= b for a, b in itertools.pairwise(rewards))  # cheaper -> higher reward
    assert all(r.reward < min(rewards) for r in infeasible)
    assert all(-2 * REWARD_CLIP <= r.reward <= REWARD_CLIP for r in results)
    # the reference plan's reward is 0: log(ref / ref)
    assert view.reference_cost is not None
    assert any(math.isclose(r.reward, 0.0, abs_tol=1e-12) for r in feasible)
    assert view.best is not None and view.best.provisioned.cost == feasible[0].provisioned.cost


def test_infeasible_reward_grows_with_the_throughput_reached():
    view = ProblemView(_tiny_problem(floor=3.0e4))  # the fastest plan reaches about 1.4e4 samples/s
    slow = view.record([0, 0])  # fc on the CPU
    fast = view.record([0, 1])  # fc on the GPU
    assert not slow.feasible and not fast.feasible
    assert slow.provisioned.max_throughput < fast.provisioned.max_throughput
    assert slow.reward < fast.reward < -REWARD_CLIP
    assert view.reference_cost is None


def test_problem_source_gives_a_new_problem_each_episode():
    env = SchedulingEnv(
        {"problem_source": lambda rng: generate_problem(rng, num_layers=(3, 30), num_types=(2, 5))}
    )
    sizes = set()
    for seed in range(6):
        env.reset(seed=seed)
        sizes.add((env.view.num_layers, env.view.num_types))
    assert len(sizes) > 1


def test_env_refuses_a_problem_wider_than_its_padding():
    problem = generate_problem(5, num_layers=(6, 6), num_types=(9, 9), catalogue="wide")
    with pytest.raises(ValueError, match="pad_types"):
        SchedulingEnv({"problem": problem, "pad_types": PRETRAIN_TYPES})
    env = SchedulingEnv({"problem": problem})  # without a pad: exactly its 9 types
    obs, _ = env.reset(seed=0)
    assert obs["type_features"].shape == (9, len(TYPE_FEATURES))


def test_the_runtime_terms_and_the_tables_place_show_in_the_observation():
    """What decides plans at size and the base model's features leave out: a GPU-cloud problem (async,
    4 micro-batches, shards hosted by one-replica plans) observes its call cost, micro-batches and hosting,
    and per GPU type whether a plan starting there keeps the table in its memory (the share of lookups it
    serves, as the cost model prices it) and how much of that memory the table takes; a problem without a
    runtime section observes zeros there, and the instance limits ahead in both."""
    from heterps_ray.costmodel.runtime_terms import table_rate

    problem = generate_problem(5, num_layers=(20, 30), num_types=(4, 6), catalogue="gpu_cloud")
    terms = problem.runtime
    assert terms is not None and terms.ps_hosting == "auto" and terms.mode == "async"
    obs, _ = SchedulingEnv({"problem": problem}).reset(seed=0)
    types, context = obs["type_features"], dict(zip(CONTEXT_FEATURES, obs["context"], strict=True))
    column = {name: types[:, TYPE_FEATURES.index(name)] for name in TYPE_FEATURES}
    assert context["runtime"] == 1.0 and context["asynchronous"] == 1.0 and context["hosting"] == 1.0
    assert context["micro_batches"] == pytest.approx(np.log2(terms.micro_batches) / 4.0)
    assert (column["call_cost"] > 0).all()
    places = [table_rate(problem, terms, r.name, hosted=True) for r in problem.resources]
    on_gpu = [p.place != "ps" for p in places]
    assert any(on_gpu) and not all(
        on_gpu
    )  # the problem has both: a type that holds the table and one that cannot
    for t, place in enumerate(places):
        assert column["table_gpu"][t] == pytest.approx(place.hit_rate if on_gpu[t] else 0.0, abs=1e-6)
        assert (column["table_memory"][t] > 0) == (
            problem.ps.table.gpu_rows.get(problem.resources[t].name, 0) > 0
        )
    # the table costs a stage 0 less per batch where its rows sit in that GPU's memory than on the shards
    assert min(column["table_ms"][on_gpu]) < min(column["table_ms"][np.logical_not(on_gpu)])

    base, _ = SchedulingEnv({"problem": _tiny_problem()}).reset(seed=0)
    runtime_columns = [TYPE_FEATURES.index(n) for n in ("call_cost", "table_gpu", "table_ms", "table_memory")]
    assert not base["type_features"][:, runtime_columns].any() and not base["context"][-4:].any()
    # the limits ahead (budget 100 ms a batch): the rest on cpu needs 3.5 replicas of its 8 instances,
    # what the gpu can run of it (fc) 0.05 of its 2
    ahead = base["type_features"][:, TYPE_FEATURES.index("limits_ahead")]
    np.testing.assert_allclose(ahead, np.log1p([3.5 / 8, 0.05 / 2]), rtol=1e-6)
