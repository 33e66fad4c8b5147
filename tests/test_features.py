"""Feature distillation offline: stage one records projected teacher block outputs on the way, stage two
learns them through projection heads (`--objective velocity+feature`)."""

from __future__ import annotations

import json

import pytest
import torch

from cache import format as F
from cache.feature_projection import matrix_sha256, projection_matrix, read_projection
from cache.manifest import load_manifest, summarize
from cache.schema import sample_bytes
from cache.verify import verify_cache
from conftest import ROOT, make_cache, read_all_samples
from test_train_student import assert_same_students, metrics
from pipeline.config import TrainStudentConfig
from pipeline.errors import UserError
from stages import train_student

TINY = str(ROOT / "configs" / "student-tiny.json")
FEATS = dict(record_features="0,1", feature_dim=8)


@pytest.fixture(scope="module")
def feature_cache(tiny_teacher, prompts_file, tmp_path_factory):
    return make_cache(tiny_teacher, prompts_file, tmp_path_factory.mktemp("feat") / "cache", **FEATS)


def train(cache, out, **kw) -> dict:
    args = dict(cache=(str(cache),), student_config=TINY, out=str(out), num_workers=0, warmup_steps=0, log_every=1,
                eval_every=0, checkpoint_every=0, lr=1e-3, batch_size=4, objective="velocity+feature",
                feature_pairs="0:0,0:1", feature_weight=0.5, device="cpu")  # compared bit for bit with two gloo ranks
    args.update(kw)
    return train_student.run(TrainStudentConfig(**args))


def test_projection_is_a_function_of_its_seed():
    a, b = projection_matrix(64, 8, seed=3), projection_matrix(64, 8, seed=3)
    assert torch.equal(a, b) and not torch.equal(a, projection_matrix(64, 8, seed=4))
    assert a.shape == (64, 8) and abs(float(a.pow(2).sum(0).mean()) - 1.0) < 0.3  # columns of unit norm on average


@pytest.mark.slow
def test_targets_are_bit_identical_with_and_without_features(tiny_cache, feature_cache):
    plain, feat = read_all_samples(tiny_cache), read_all_samples(feature_cache)
    assert plain.keys() == feat.keys()
    for key, (tensors, meta) in plain.items():
        t2, m2 = feat[key]
        assert meta == m2
        for name in (F.T_X_T, F.T_TARGET):
            assert torch.equal(tensors[name], t2[name]), (key, name)
        assert F.T_FEATURES not in tensors and t2[F.T_FEATURES].shape == (2, 16, 8)  # 2 blocks, 4x4 tokens, D=8
    m, m0 = load_manifest(feature_cache), load_manifest(tiny_cache)
    assert m.sample_fields == [F.T_X_T, F.T_TARGET, F.T_FEATURES]
    assert m.fingerprint != m0.fingerprint  # features are part of the fingerprint
    assert "record_features" not in m0.to_json()  # a cache without them keeps its fingerprint's fields as before


@pytest.mark.slow
def test_feature_field_round_trips_through_writer_reader_and_verify(feature_cache, tmp_path):
    m = load_manifest(feature_cache)
    matrix = read_projection(feature_cache, m.feature_projection_sha256)
    assert torch.equal(matrix, projection_matrix(matrix.shape[0], 8, m.feature_seed))
    assert matrix_sha256(matrix) == m.feature_projection_sha256
    assert verify_cache(feature_cache, progress=False) == []
    info = summarize(feature_cache)
    assert info["tensor_bytes_per_sample"] - info["tensor_bytes_per_sample_without_features"] == 2 * 16 * 8 * 4
    assert sample_bytes(m, [F.T_FEATURES]) == 2 * 16 * 8 * 4  # float32 cache
    # A projection that is not the recorded one is caught.
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(feature_cache, broken)
    from safetensors.torch import save_file

    save_file({F.P_MATRIX: matrix * 2}, broken / F.FEATURE_PROJECTION)
    assert any(F.FEATURE_PROJECTION in p for p in verify_cache(broken, progress=False))


@pytest.mark.slow
def test_velocity_feature_trains_resumes_bit_equal_and_is_refused_without_features(tiny_cache, feature_cache,
                                                                                    tmp_path, monkeypatch):
    with pytest.raises(UserError, match="needs cache field.*features.*--record-features"):
        train(tiny_cache, tmp_path / "nofeat", max_steps=1)
    with pytest.raises(UserError, match="teacher block.*\\[5\\].*did not record"):
        train(feature_cache, tmp_path / "badpair", max_steps=1, feature_pairs="0:5")
    kw = dict(max_steps=6, checkpoint_every=2, ema_decay=0.9)
    full = tmp_path / "full"
    train(feature_cache, full, **kw)
    cut = tmp_path / "cut"
    monkeypatch.setenv("WANDISTILLER_FAIL_AT", "0:5")
    with pytest.raises(RuntimeError, match="injected failure"):
        train(feature_cache, cut, **kw)
    monkeypatch.delenv("WANDISTILLER_FAIL_AT")
    train(feature_cache, cut, resume=True, **kw)
    assert [r["loss"] for r in metrics(cut)] == [r["loss"] for r in metrics(full)]
    assert metrics(full)[-1]["loss_feature"] > 0 and "loss_velocity" in metrics(full)[-1]
    assert_same_students(cut, full)
    d = json.loads((full / "distill.json").read_text())
    assert d["objective"] == "velocity+feature"
    assert d["objective_settings"] == {"feature_pairs": "0:0,0:1", "feature_weight": 0.5}


@pytest.mark.dist
@pytest.mark.slow
def test_feature_objective_on_two_ranks_matches_one_process(feature_cache, tmp_path):
    from test_train_student import max_rel_diff, weights
    from test_train_student_dist import ARGS, torchrun

    extra = dict(objective="velocity+feature", feature_pairs="0:0,0:1", feature_weight=0.5)
    proc = torchrun(feature_cache, tmp_path / "two", {}, 240, **ARGS, **extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    train(feature_cache, tmp_path / "one", **(ARGS | dict(batch_size=4, log_every=1)))
    for name in ("student", "student_ema"):
        assert max_rel_diff(weights(tmp_path / "two" / name), weights(tmp_path / "one" / name)) <= 1e-5, name
