"""`heterps data synth`: a known achievable AUC, power-law keys, determinism, the same read path."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from heterps_ray.cli import main
from heterps_ray.data.criteo import SPARSE_COLUMNS
from heterps_ray.data.dataset import Dataset
from heterps_ray.data.synth import HiddenModel, SynthSpec, synthesize
from heterps_ray.errors import ConfigError

_ROWS = 20_000


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "s20k"
    synthesize(out, _ROWS, seed=3, rows_per_part=8_000)
    return Dataset(out)


def test_small_synth_knows_its_achievable_auc(small):
    meta = small.meta
    print(
        f"achievable AUC {meta['achievable_auc']:.4f} (expected {meta['expected_auc']}), ctr {meta['ctr']:.4f}"
    )
    assert 0.6 < meta["achievable_auc"] < 0.95
    assert abs(meta["achievable_auc"] - meta["expected_auc"]) < 0.04  # 2,000 eval rows: sampling noise
    assert abs(meta["ctr"] - 0.25) < 0.02
    assert meta["kind"] == "synthetic" and meta["rows"] == {"train": 18_000, "eval": 2_000}
    assert small.num_rows("train") == 18_000 and len(small.files("train")) == 3
    batch = small.load("eval")
    assert abs(batch["label"].mean() - meta["ctr"]) < 0.03


def test_key_frequencies_follow_a_power_law(small):
    keys = small.load("train")["keys"]
    truth = small.meta["truth"]
    slot = int(np.argmax(truth["vocab_sizes"]))  # the largest vocabulary shows the tail best
    _, counts = np.unique(keys[:, slot], return_counts=True)
    counts = np.sort(counts)[::-1]
    ranks = np.arange(1, 31)
    slope = np.polyfit(np.log(ranks), np.log(counts[:30]), 1)[0]
    print(f"slot C{slot + 1}: {len(counts)} distinct keys, log-log slope {slope:.2f}")
    assert -2.0 < slope < -0.7
    assert counts[0] > 20 * counts[29]  # a few keys dominate
    assert len(counts) <= truth["vocab_sizes"][slot] + 1  # values of the vocabulary (+ missing)
    distinct = [len(np.unique(keys[:, s])) for s in range(keys.shape[1])]
    assert min(distinct) >= 20 and max(distinct) < 10_001


def test_values_are_criteo_like_strings_and_missing_where_criteo_has_them(small):
    raw = pq.read_table(small.files("train")[0])
    values = raw.column("C1").drop_null().to_pylist()[:100]
    assert all(len(v) == 8 and int(v, 16) >= 0 for v in values)
    missing = [raw.column(f"C{s + 1}").null_count / raw.num_rows for s in range(26)]
    assert sum(m > 0.1 for m in missing) == 6
    assert raw.column("I1").type.id == raw.schema.field("I5").type.id  # float64 counts
    assert all(v == int(v) and v >= 0 for v in raw.column("I5").drop_null().to_pylist()[:100])


def test_same_seed_same_data_other_seed_other_data(small, tmp_path):
    synthesize(tmp_path / "again", _ROWS, seed=3, rows_per_part=8_000)
    again = Dataset(tmp_path / "again")
    for key, value in small.load("eval").items():
        np.testing.assert_array_equal(again.load("eval")[key], value)
    assert again.meta["achievable_auc"] == small.meta["achievable_auc"]
    other = HiddenModel(4)
    assert other.vocab_sizes.tolist() != small.meta["truth"]["vocab_sizes"]


def test_target_auc_moves_the_truth(tmp_path):
    easy = synthesize(tmp_path / "easy", 10_000, seed=1, spec=SynthSpec(target_auc=0.9))
    hard = synthesize(tmp_path / "hard", 10_000, seed=1, spec=SynthSpec(target_auc=0.65))
    assert easy["achievable_auc"] > 0.85 and hard["achievable_auc"] < 0.72
    with pytest.raises(ConfigError, match="target_auc"):
        SynthSpec(target_auc=0.99).check()


def test_cli_synth_prints_the_achievable_auc(tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["data", "synth", "--rows", "5000", "--output", str(out), "--seed", "2"]) == 0
    printed = capsys.readouterr().out
    assert "achievable AUC" in printed and "train 4500 rows" in printed
    assert f"{Dataset(out).meta['achievable_auc']:.4f}" in printed
    assert main(["data", "synth", "--rows", "5000", "--output", str(out)]) == 2  # exists
    assert main(["data", "synth", "--rows", "10", "-o", str(tmp_path / "b"), "--base-ctr", "1.5"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["data", "synth", "--rows", "0", "--output", str(tmp_path / "zero")])
    assert exc.value.code == 2


def test_achievable_auc_matches_the_pairwise_definition():
    from heterps_ray.data.synth import _auc

    rng = np.random.default_rng(0)
    labels = (rng.random(600) < 0.3).astype(np.int8)
    scores = np.round(rng.normal(labels, 1.0), 1)  # many ties
    pos, neg = scores[labels == 1][:, None], scores[labels == 0][None, :]
    pairwise = ((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size)
    assert _auc(scores, labels) == pytest.approx(pairwise, abs=1e-12)


def _distinct_keys_per_slot(dataset: Dataset) -> list[int]:
    keys = np.concatenate([dataset.load(split)["keys"] for split in ("train", "eval")])
    return [len(np.unique(keys[:, s])) for s in range(keys.shape[1])]


def test_meta_records_each_slots_distinct_values_in_synth_and_convert(small, tmp_path):
    from heterps_ray.data.convert import convert
    from heterps_ray.data.criteo import SPARSE_COLUMNS, write_text

    exact = _distinct_keys_per_slot(small)  # the keys the sparse table will see, missing included
    assert small.meta["distinct_values"] == dict(zip(SPARSE_COLUMNS, exact, strict=True))
    assert small.meta["distinct_values_total"] == sum(exact) > 26 * 20
    text = tmp_path / "small.tsv"
    write_text(pq.read_table(small.files("train")[0]), text)
    meta = convert([text], tmp_path / "converted")
    assert meta["distinct_values"] == dict(
        zip(SPARSE_COLUMNS, _distinct_keys_per_slot(Dataset(tmp_path / "converted")), strict=True)
    )


def test_distinct_counter_is_exact_when_small_and_within_2_percent_when_large():
    import pyarrow as pa

    from heterps_ray.data.writer import DistinctCounter

    rng = np.random.default_rng(0)
    for n in (1_000, DistinctCounter.EXACT_MAX, 3 * DistinctCounter.EXACT_MAX, 2_000_000):
        counter = DistinctCounter()
        values = pa.array(np.char.mod("%08x", rng.permutation(4 * n)[:n]).astype(object))
        for chunk in (values, values.slice(n // 3), pa.array([None, "", None])):  # repeats, missing
            counter.add(chunk)
        if n <= DistinctCounter.EXACT_MAX - 1:
            assert counter.count() == n + 1  # the values and the missing one ("")
        else:
            assert abs(counter.count() / n - 1) < 0.02, (n, counter.count())


def test_key_frequencies_are_exact_when_small_and_within_3_percent_when_sampled():
    """How many keys a slot shows at least n times: exact while a slot has few keys; beyond, a hash
    sample of them (here at most 2,000 kept, for 120,000 keys) scaled up, against the exact figures."""
    import pyarrow as pa

    from heterps_ray.data.criteo import hash_slot
    from heterps_ray.data.writer import KeyFrequencies

    rng = np.random.default_rng(4)
    for distinct, exact_max in ((500, KeyFrequencies.EXACT_MAX), (120_000, 2_000)):
        ranks = (rng.pareto(0.8, size=6 * distinct) * distinct / 50).astype(np.int64) % distinct
        values = pa.array(np.char.mod("%08x", ranks).astype(object))
        values = pa.concat_arrays([values, pa.array([None, "", None])])  # missing: the key of ""
        counter = KeyFrequencies(slot=3, exact_max=exact_max)
        for start in range(0, len(values), 7_000):  # in chunks, as the writer adds them
            counter.add(values.slice(start, 7_000))
        _, counts = np.unique(hash_slot(values, 3), return_counts=True)
        exact = [int((counts >= n).sum()) for n in range(1, KeyFrequencies.MAX_N + 1)]
        got = counter.at_least()
        if exact_max == KeyFrequencies.EXACT_MAX:
            assert got == exact and counter.level == 0
        else:
            assert counter.level >= 5  # 120,000 keys sampled down under 2,000
            for n, (g, e) in enumerate(zip(got, exact, strict=True), start=1):
                assert abs(g / e - 1) < 0.03 + 3 / np.sqrt(e / 2**counter.level), (n, g, e)


def test_meta_counts_the_train_keys_seen_at_least_n_times(small):
    train = small.load("train")["keys"]
    meta = small.meta["train_keys_at_least"]
    for s, name in enumerate(SPARSE_COLUMNS):
        _, counts = np.unique(train[:, s], return_counts=True)
        assert meta[name] == [int((counts >= n).sum()) for n in range(1, 9)], name
    assert "keys of the train split in at least n rows" in small.meta["train_keys_at_least_method"]


def test_criteo_kaggle_shape_has_criteos_distinct_values_at_full_size_and_heavy_tails(tmp_path):
    from heterps_ray.data.synth import (
        CRITEO_KAGGLE_DISTINCT,
        CRITEO_KAGGLE_ROWS,
        SHAPES,
        expected_distinct,
        power_law_ranks,
    )

    assert sum(CRITEO_KAGGLE_DISTINCT) == 33_762_577 and CRITEO_KAGGLE_ROWS == 45_840_617
    spec = SynthSpec(**SHAPES["criteo-kaggle"])
    meta = synthesize(tmp_path / "kaggle", 30_000, seed=1, spec=spec, rows_per_part=15_000)
    truth = meta["truth"]
    # solved vocabularies: 45.8M rows of this truth are expected to show Criteo's counts
    for got, want in zip(truth["expected_distinct_at_reference_rows"], CRITEO_KAGGLE_DISTINCT, strict=True):
        assert abs(got - want) <= max(1, 1e-3 * want)
    assert all(v >= d for v, d in zip(truth["vocab_sizes"], CRITEO_KAGGLE_DISTINCT, strict=True))
    # the sampler draws what the solver counts on (the biggest slot, 200k draws)
    big = int(np.argmax(truth["vocab_sizes"]))
    vocab, a = truth["vocab_sizes"][big], truth["zipf_exponents"][big]
    drawn = len(np.unique(power_law_ranks(np.random.default_rng(2).random(200_000), vocab, a)))
    assert abs(drawn / expected_distinct(vocab, a, 200_000) - 1) < 0.01
    # 30k rows: the big slots are mostly one-off values (heavy tails), the small ones are all seen
    dataset = Dataset(tmp_path / "kaggle")
    distinct = _distinct_keys_per_slot(dataset)
    assert distinct[2] > 0.5 * 30_000 * (1 - truth["slot_missing"][2])  # C3: 10.1M values in Criteo
    assert distinct[8] <= 3 + 1 and distinct[19] <= 4 + 1  # C9 and C20: 3 and 4 values (+ missing)
    assert abs(meta["achievable_auc"] - meta["expected_auc"]) < 0.05 and 0.6 < meta["achievable_auc"] < 0.95
    values = pq.read_table(dataset.files("train")[0]).column("C3").drop_null().to_pylist()[:50]
    assert all(len(v) == 8 and int(v, 16) >= 0 for v in values)


def test_cli_synth_criteo_kaggle_shape(tmp_path, capsys):
    out = tmp_path / "cli-kaggle"
    assert main(["data", "synth", "--shape", "criteo-kaggle", "--rows", "3000", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    meta = Dataset(out).meta
    assert meta["truth"]["spec"]["distinct_values"][2] == 10_131_227
    assert f"distinct keys: {meta['distinct_values_total']:,}" in printed
