"""On-the-fly target features (`--features on-the-fly`) on a tiny random target: the same arrays and
batches as the feature cache for the same sequences, and training steps run from them."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from blockspec.models import data, target as tgt  # noqa: E402
from fixtures_target import write_tiny_gguf  # noqa: E402
from blockspec.models.train import Batches, TrainConfig, train  # noqa: E402
from blockspec.runtime.errors import BlockspecError  # noqa: E402

TINY = dict(dim=48, n_layer=4, n_head=4, n_kv_head=2, head_dim=12, ffn_dim=64, vocab_size=97,
            rope_base=10000.0, norm_eps=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("online")
    path = d / "tiny-llama.gguf"
    write_tiny_gguf(path, tgt.ModelArgs(arch="llama", **TINY), seed=5)
    target = tgt.load_target(path)
    rng = np.random.default_rng(0)
    # uneven lengths, so chunks and batches pad differently in the two paths
    seqs = [[int(t) for t in rng.integers(3, 97, size=rng.integers(12, 41))] for _ in range(10)]
    cache = data.write_feature_cache(target, seqs, d / "cache", layers=[1, 2, 3], max_len=40,
                                     shard_size=4, batch_size=4, progress=False)
    return path, target, cache, seqs


def test_online_rows_and_batches_equal_the_cache(tiny):
    path, target, cache, seqs = tiny
    cached = data.CachedFeatures.load(cache, [3, 1])
    online = data.OnlineFeatures(target, seqs, [3, 1], batch_size=3)
    assert np.array_equal(cached.lengths, online.lengths)
    idx = np.array([7, 2, 7, 0, 9])  # a repeat, and rows from different cache chunks
    a, b = cached.rows(idx), online.rows(idx)
    assert a.keys() == b.keys()
    real = np.arange(a["tokens"].shape[1])[None, :] < cached.lengths[idx][:, None]  # [B, S]; past it: padding
    for k in ("tokens", "greedy", "top_ids"):
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(a[k][real], b[k][real]), k
    for k in ("feats", "top_logp"):  # f16 in both; chunk shapes may reorder float sums
        assert a[k].dtype == b[k].dtype == np.float16 and a[k].shape == b[k].shape
        np.testing.assert_allclose(a[k][real].astype(np.float32), b[k][real].astype(np.float32), atol=2e-3, rtol=2e-3)
    assert not b["feats"][~real].any()
    # the trainer's batches: same rows, anchors, labels; the features a block can see agree
    ba = Batches(cached, 4, 0.2, seed=0).get_batch("train", 4, 6, np.random.default_rng(1), span=8)
    bb = Batches(online, 4, 0.2, seed=0).get_batch("train", 4, 6, np.random.default_rng(1), span=8)
    v = ba["valid"]
    for k in ("anchors", "last", "valid"):
        assert torch.equal(ba[k], bb[k]), k
    for k in ("labels", "data_next", "top_ids"):
        assert torch.equal(ba[k][v], bb[k][v]), k
    torch.testing.assert_close(ba["top_logp"][v], bb["top_logp"][v], atol=2e-3, rtol=2e-3)
    seen = torch.arange(ba["feats"].shape[1])[None, :] <= ba["anchors"].max(1).values[:, None]  # [B, S]
    torch.testing.assert_close(ba["feats"][seen], bb["feats"][seen], atol=2e-3, rtol=2e-3)
    print("max |feats cache - on-the-fly| where seen:", float((ba["feats"][seen] - bb["feats"][seen]).abs().max()))


def test_training_steps_on_the_fly(tiny, tmp_path):
    path, target, cache, seqs = tiny
    cfg = TrainConfig(method="specblock", target=str(path), out=str(tmp_path / "otf"), features="on-the-fly",
                      n_layer=1, draft_vocab_size=16, steps=2, batch_size=2, anchors_per_seq=4, warmup=1,
                      eval_every=2, eval_batches=1, save_every=2, log_every=1, target_layers=[1, 3],
                      cross_block_weight=0.5)
    calls = []
    src = data.OnlineFeatures(target, seqs, [1, 3])
    rows = src.rows
    src.rows = lambda idx: calls.append(len(idx)) or rows(idx)
    res = train(cfg, target=target, progress=False, source=src)
    # the feature-scale fit, two training batches, one held-out batch
    assert len(calls) == 4 and res["blocks"] > 0
    meta = json.loads((tmp_path / "otf" / "drafter.json").read_text())
    assert meta["step"] == 2 and meta["config"]["features"] == "on-the-fly"
    # the draft vocabulary comes from the text's token counts (no greedy labels before training)
    from blockspec.models.train import load_drafter

    model, _ = load_drafter(tmp_path / "otf", target)
    counts = np.bincount(np.concatenate(seqs), minlength=97)
    assert model.vocab.d2t.tolist() == np.argsort(-counts, kind="stable")[:16].tolist()


def test_feature_source_options(tiny, tmp_path):
    from click.testing import CliRunner

    from blockspec.models.cli import train as group

    path, *_ = tiny
    r = CliRunner().invoke(group, ["specblock", "--help"])
    assert r.exit_code == 0 and "--features [cache|on-the-fly]" in r.output and "--cross-block-weight" in r.output
    r = CliRunner().invoke(group, ["specblock", "--target", str(path), "--out", str(tmp_path / "x")])
    assert isinstance(r.exception, BlockspecError) and "--data DIR" in str(r.exception)
    r = CliRunner().invoke(group, ["specblock", "--target", str(path), "--out", str(tmp_path / "x"),
                                   "--features", "online"])
    assert r.exit_code == 2 and "on-the-fly" in r.output
    r = CliRunner().invoke(group, ["specblock", "--target", str(path), "--out", str(tmp_path / "x"),
                                   "--data", str(tmp_path / "nothing")])
    assert isinstance(r.exception, BlockspecError) and "no feature cache" in str(r.exception)
    with pytest.raises(BlockspecError, match="no training sequences"):
        data.OnlineFeatures(tgt.load_target(path), [], [1])
