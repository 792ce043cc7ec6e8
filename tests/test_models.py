"""The model zoo: layer metadata matches the real modules, slices equal the full model, kwargs checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from heterps_ray.config import ModelConfig, load_model
from heterps_ray.errors import ConfigError
from heterps_ray.models import MODELS, ModelSpec, build_model, loss_fn

REPO = Path(__file__).resolve().parents[1]
BATCH = 8


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """One intra-op thread: on a shared 2-core machine two OpenMP threads mostly spin-wait."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _inputs(spec: ModelSpec, batch: int = BATCH, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(batch, spec.num_dense, generator=gen) * 3
    emb = (torch.rand(batch, spec.num_slots, spec.embedding_dim, generator=gen) - 0.5) * 0.2
    return dense, emb


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_layer_declares_what_its_module_does(name):
    spec = MODELS[name]()
    net = spec.build(0, None, seed=0)
    x = _inputs(spec)
    for i, (layer, meta) in enumerate(zip(net.layers, spec.layers, strict=True)):
        with FlopCounterMode(display=False) as counter:
            y = layer(x)
        out_bytes = sum(t.numel() * t.element_size() for t in y) // BATCH
        assert out_bytes == meta.out_bytes_per_sample, meta.name
        assert sum(p.numel() for p in layer.parameters()) == meta.dense_params, meta.name
        assert meta.sparse_rows_per_sample == (spec.num_slots if i == 0 else 0), meta.name
        # matmul FLOPs are counted exactly by torch; the declared figure adds elementwise work only
        matmul = counter.get_total_flops() / BATCH
        elements = sum(t[0].numel() for t in (*x, *y))
        assert matmul <= meta.flops_per_sample <= matmul + 8 * elements, meta.name
        assert 0.0 < meta.parallel_fraction <= 1.0
        assert all(t.dtype == torch.float32 and t.shape[0] == BATCH for t in y)
        x = y
    assert len(x) == 1 and x[0].shape == (BATCH,)
    assert spec.dense_params == sum(p.numel() for p in net.parameters())


def test_ctr_dnn_is_paddlerec_shape():
    spec = build_model(load_model(REPO / "configs" / "models" / "ctr_dnn.yaml"))
    assert [layer.name for layer in spec.layers] == ["embedding", "fc1", "fc2", "fc3", "fc4", "logit"]
    assert (spec.num_slots, spec.num_dense, spec.embedding_dim) == (26, 13, 9)
    fc_widths = [layer.out_bytes_per_sample // 4 for layer in spec.layers[1:5]]
    assert fc_widths == [512, 256, 128, 32]
    assert spec.layers[0].out_bytes_per_sample == 4 * (26 * 9 + 13)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_slice_has_the_weights_of_the_same_layers_of_the_full_model(name):
    spec = MODELS[name]()
    full = spec.build(0, None, seed=11)
    start, end = 1, spec.num_layers - 1
    torch.manual_seed(123)  # the caller's RNG state must not matter
    part = spec.build(start, end, seed=11)
    assert part.first == start and len(part.layers) == end - start
    for offset, layer in enumerate(part.layers):
        expected = full.layers[start + offset].state_dict()
        got = layer.state_dict()
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(expected[key], got[key]), (name, start + offset, key)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_chained_slices_compute_the_full_model(name):
    spec = MODELS[name]()
    x = _inputs(spec)
    (expected,) = spec.build(0, None, seed=3)(x)
    cuts = [0, 1, spec.num_layers // 2, spec.num_layers]
    y = x
    for start, end in zip(cuts, cuts[1:], strict=False):
        y = spec.build(start, end, seed=3)(y)
    assert torch.equal(y[0], expected)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradient_reaches_every_slot_embedding(name):
    spec = MODELS[name]()
    dense, emb = _inputs(spec)
    emb.requires_grad_(True)
    (logit,) = spec.build(0, None, seed=0)((dense, emb))
    loss_fn(logit, torch.ones(BATCH)).backward()
    assert emb.grad is not None
    assert (emb.grad.abs().sum(dim=(0, 2)) > 0).all()


def test_seed_and_layer_index_set_the_weights():
    spec = MODELS["ctr_dnn"]()
    a, b = spec.build(0, None, seed=0), spec.build(0, None, seed=1)
    assert not torch.equal(a.layers[1].linear.weight, b.layers[1].linear.weight)
    # two layers of the same shape in one model do not share their initial weights
    deepfm = MODELS["deepfm"]().build(0, None, seed=0)
    assert not torch.equal(deepfm.layers[3].linear.weight, deepfm.layers[4].linear.weight)


def test_slice_bounds_are_checked():
    spec = MODELS["ctr_dnn"]()
    for start, end in [(3, 3), (-1, 2), (0, spec.num_layers + 1)]:
        with pytest.raises(ValueError, match="start"):
            spec.build(start, end, seed=0)


def test_attention_model_is_the_compute_heavy_one():
    flops = {name: sum(layer.flops_per_sample for layer in MODELS[name]().layers) for name in MODELS}
    assert max(flops, key=flops.get) == "autoint"
    assert flops["autoint"] > 5 * flops["ctr_dnn"]


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "models").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_model_configs_build(path):
    config = load_model(path)
    spec = build_model(config, file=str(path))
    assert spec.name == config.name
    (logit,) = spec.build(0, None, seed=0)(_inputs(spec, batch=2))
    assert logit.shape == (2,)


@pytest.mark.parametrize(
    ("params", "field", "expected"),
    [
        ({"name": "ctr_dnn", "hiden": [8]}, "model.hiden", "a parameter of ctr_dnn"),
        ({"name": "ctr_dnn", "hidden": [64, -1]}, "model.hidden.1", "a positive integer"),
        ({"name": "ctr_dnn", "hidden": 64}, "model.hidden", "a non-empty list"),
        ({"name": "dlrm", "embedding_dim": "16"}, "model.embedding_dim", "a positive integer"),
        ({"name": "autoint", "init_scale": 0}, "model.init_scale", "a positive number"),
        ({"name": "resnet"}, "model.name", "one of"),
    ],
)
def test_bad_model_config_names_the_field(params, field, expected):
    with pytest.raises(ConfigError) as err:
        build_model(ModelConfig(**params), file="job.yaml")
    assert err.value.field == field
    assert expected in str(err.value) and "job.yaml" in str(err.value)
