"""SpecBlock cross-block training on a tiny random target: off = the old loss bit for bit; block 2's
labels, last token and visible context line up; its loss reaches block 1 through the chained
state; a short overfit with it on still converges."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from blockspec.models import build_model, data, losses, target as tgt  # noqa: E402
from fixtures_target import write_tiny_gguf  # noqa: E402
from blockspec.models.specblock import rank_bucket_labels  # noqa: E402
from blockspec.models.train import (Batches, TrainConfig, block_view, check_config, compute_loss,  # noqa: E402
                                    cross_block_forward, loss_terms, make_model_args, train)
from blockspec.runtime.errors import BlockspecError  # noqa: E402

TINY = dict(dim=48, n_layer=4, n_head=4, n_kv_head=2, head_dim=12, ffn_dim=64, vocab_size=97,
            rope_base=10000.0, norm_eps=1e-6)
LAYERS = [1, 3]
K = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("xb")
    path = d / "tiny-llama.gguf"
    write_tiny_gguf(path, tgt.ModelArgs(arch="llama", **TINY), seed=5)
    target = tgt.load_target(path)
    rng = np.random.default_rng(0)
    phrases = [list(rng.integers(3, 97, size=8)) for _ in range(4)]
    seqs = [[int(t) for _ in range(5) for t in phrases[rng.integers(0, 4)]] for _ in range(12)]
    cache = data.write_feature_cache(target, seqs, d / "cache", layers=[1, 2, 3], max_len=40,
                                     shard_size=5, batch_size=4, progress=False)
    return path, target, cache


def _cfg(path, cache, **kw):
    base = dict(method="specblock", target=str(path), out="", data=str(cache), n_layer=1, draft_vocab_size=0,
                target_layers=LAYERS, batch_size=4, anchors_per_seq=8)
    return TrainConfig(**{**base, **kw})


def _model(cfg, target, seed=0):
    torch.manual_seed(seed)
    m = build_model(make_model_args(cfg, target.args))
    return m.bind_target(target.tok_embeddings.weight, target.head_weight)


def _old_get_batch(d, rows_pool, P, batch_size, anchors, rng):
    """get_batch as it was before feature sources and spans (commit 3db4833), for the parity check."""
    rows = rng.choice(rows_pool, size=batch_size)
    lengths = d["lengths"][rows]
    S = int(lengths.max())
    hi = np.maximum(lengths - 2, 0)
    anc = np.stack([rng.integers(0, h + 1, size=anchors) for h in hi])
    pos = anc[..., None] + 1 + np.arange(P)
    valid = pos < lengths[:, None, None] - 1
    pos_c = np.minimum(pos, S - 1)
    r = rows[:, None, None]
    return dict(
        feats=torch.from_numpy(d["feats"][rows, :S].astype(np.float32)),
        anchors=torch.from_numpy(anc).long(),
        last=torch.from_numpy(d["tokens"][rows[:, None], anc + 1]).long(),
        labels=torch.from_numpy(d["greedy"][r, pos_c]).long(),
        data_next=torch.from_numpy(d["tokens"][r, np.minimum(pos_c + 1, S - 1)]).long(),
        valid=torch.from_numpy(valid),
        top_ids=torch.from_numpy(d["top_ids"][r, pos_c]).long(),
        top_logp=torch.from_numpy(d["top_logp"][r, pos_c].astype(np.float32)),
    )


def test_off_is_the_old_loss_exactly(tiny):
    path, target, cache = tiny
    src = data.CachedFeatures.load(cache, LAYERS)
    cfg = _cfg(path, cache, distill_weight=0.3)
    model = _model(cfg, target)
    batches = Batches(src, K, 0.0, seed=3)
    b = batches.get_batch("train", 4, 8, np.random.default_rng(7))
    old = _old_get_batch(src.d, batches.split["train"], K, 4, 8, np.random.default_rng(7))
    assert b.keys() == old.keys() and all(torch.equal(b[k], old[k]) for k in b)
    # the loss formula before cross-block training existed
    out = model(old["feats"], old["anchors"], old["last"])
    lab = model.vocab.t2d(old["labels"])
    ce, keep = losses.block_cross_entropy(out.logits, lab, old["valid"], True, None)
    rank = losses.rank_bucket_cross_entropy(out.rank_logits, rank_bucket_labels(out.logits.detach(), lab, [1, 2, 4, 8]),
                                            keep)
    kd = losses.distill_kl(out.logits, model.vocab.t2d(old["top_ids"]), old["top_logp"], keep, 1.0)
    want = ce + cfg.rank_weight * rank + cfg.distill_weight * kd
    loss, parts, _ = compute_loss(model, b, cfg)
    assert torch.equal(loss, want) and set(parts) == {"ce", "rank", "kd"}
    # on: the block-1 terms are untouched (same rows and anchors, same numbers), block 2 is added
    on = dataclasses.replace(cfg, cross_block_weight=0.5)
    bs = batches.get_batch("train", 4, 8, np.random.default_rng(7), span=2 * K)
    assert all(torch.equal(block_view(bs, 0, K)[k], b[k]) for k in b)
    loss_on, parts_on, _ = compute_loss(model, bs, on)
    assert {k: parts_on[k] for k in parts} == parts and {"xb_ce", "xb_rank", "xb_kd"} <= set(parts_on)
    assert float(loss_on.detach()) > float(loss.detach())


@pytest.mark.parametrize("shift", [K, 2])
def test_block2_alignment_and_visible_context(tiny, shift):
    path, target, cache = tiny
    src = data.CachedFeatures.load(cache, LAYERS)
    model = _model(_cfg(path, cache), target).eval()
    batches = Batches(src, K, 0.0, seed=1)
    b = batches.get_batch("train", 4, 1, np.random.default_rng(2), span=shift + K)
    b2 = block_view(b, shift, K)
    rows = np.random.default_rng(2).choice(batches.split["train"], size=4)  # the rows get_batch drew
    for i, row in enumerate(rows):
        t2 = int(b["anchors"][i, 0]) + shift  # block 2's anchor
        n = int(src.lengths[row])
        for k in range(K):
            if b2["valid"][i, 0, k]:  # block 2's k-th label: the target's greedy token at t2+1+k
                assert int(b2["labels"][i, 0, k]) == int(src.d["greedy"][row, t2 + 1 + k])
        if t2 + 1 < n:  # its last token: the text's x[t2+1]
            assert int(b["data_next"][i, 0, shift - 1]) == int(src.d["tokens"][row, t2 + 1])
    # block 2 sees the target's features up to block 1's anchor t only, not t+1 .. t+shift
    with torch.no_grad():
        out = model(b["feats"], b["anchors"], b["last"])
        ref = cross_block_forward(model, b, out, shift).logits
        f = b["feats"].clone()
        for i in range(4):
            f[i, int(b["anchors"][i, 0]) + 1:] += 5.0 * torch.randn_like(f[i, int(b["anchors"][i, 0]) + 1:])
        got = cross_block_forward(model, {**b, "feats": f}, out, shift).logits
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        f[:, 0] += 1.0  # ... and it does see those
        assert not torch.allclose(cross_block_forward(model, {**b, "feats": f}, out, shift).logits, ref)


def test_block2_loss_reaches_block1_through_its_state(tiny):
    path, target, cache = tiny
    cfg = _cfg(path, cache, cross_block_weight=1.0, cross_block_shift=3)
    model = _model(cfg, target)
    b = Batches(data.CachedFeatures.load(cache, LAYERS), K, 0.0, seed=0).get_batch("train", 4, 8, span=3 + K)
    seen = []

    def keep_grad(_mod, _inp, out):
        out.retain_grad()
        seen.append(out)

    h = model.norm.register_forward_hook(keep_grad)  # final-normed states: block 1, then block 2
    parts, _ = loss_terms(model, b, cfg)
    h.remove()
    assert len(seen) == 2
    parts["xb_ce"].backward()
    g = seen[0].grad  # d(block-2 CE) / d(block-1 states) [B, N, K, H]
    assert g is not None and g[:, :, 2].abs().sum() > 0  # slot m-1 = 2 conditions block 2
    assert g[:, :, [0, 1, 3]].abs().sum() == 0  # no other block-1 state is read


def test_cross_block_loss_function_checks_its_span():
    logits = torch.randn(2, 3, 4, 11)
    labels = torch.randint(0, 11, (2, 3, 6))
    valid = torch.ones(2, 3, 6, dtype=torch.bool)
    loss, keep = losses.cross_block_cross_entropy(logits, labels, valid, 2)
    want, _ = losses.block_cross_entropy(logits, labels[..., 2:6], valid[..., 2:6])
    assert torch.equal(loss, want) and keep.shape == (2, 3, 4)
    with pytest.raises(ValueError, match="cross-block shift"):
        losses.cross_block_cross_entropy(logits, labels, valid, 3)


def test_config_errors(tiny):
    path, _, cache = tiny
    with pytest.raises(BlockspecError, match="SpecBlock"):
        check_config(_cfg(path, cache, method="dblast", cross_block_weight=1.0))
    with pytest.raises(BlockspecError, match="cross-block-shift 5"):
        check_config(_cfg(path, cache, cross_block_weight=1.0, cross_block_shift=5))
    check_config(_cfg(path, cache, cross_block_weight=1.0, cross_block_shift=K))


def test_overfit_with_cross_block(tiny, tmp_path):
    path, target, cache = tiny
    cfg = _cfg(path, cache, out=str(tmp_path / "xb"), steps=60, lr=3e-3, warmup=5, eval_every=60, eval_batches=2,
               save_every=1000, log_every=1000, heldout_frac=0.0, cross_block_weight=1.0)
    res = train(cfg, target=target, progress=False)
    # block 1 learns as without the term (tests/test_models_train.py's bar); the chained block,
    # with no target features past t, still learns the phrases' continuations
    assert min(res["match_per_pos"]) > 0.5 and res["accept"] > 0.5, res
    assert res["xb_blocks"] > 0 and res["xb_match_per_pos"][0] > 0.5, res
