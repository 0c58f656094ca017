"""Shared runner over tiny random configs for every drafter: shapes, cache vs no cache, packed
anchors vs one block at a time, batch of 2; plus the layer-wise shift's direction."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from blockspec.models import build_model, model_module  # noqa: E402

V, H, TD = 53, 32, 24
TINY = dict(dim=H, n_layer=2, n_head=4, n_kv_head=2, head_dim=8, ffn_dim=48, vocab_size=V,
            target_layers=[1, 2], target_dim=TD, rope_base=10000.0)
CONFIGS = {
    "specblock": dict(TINY, model_type="specblock", block_size=4),
    "specblock_l3_dvocab": dict(TINY, model_type="specblock", block_size=3, n_layer=3, draft_vocab_size=20),
    "dblast": dict(TINY, model_type="dblast", block_size=5, n_categories=1),
    "dblast_kz3": dict(TINY, model_type="dblast", block_size=4, n_categories=3, draft_vocab_size=20),
    "dblast_qk": dict(TINY, model_type="dblast", block_size=5, n_categories=1, qk_norm=True),
}


def make(name, seed=0):
    torch.manual_seed(seed)
    m = build_model(CONFIGS[name])
    g = torch.Generator().manual_seed(seed + 1)
    m.bind_target(torch.randn(V, H, generator=g), torch.randn(V, H, generator=g))
    if m.args.draft_vocab_size:
        m.vocab.set_vocab(torch.randperm(V, generator=g)[: m.args.draft_vocab_size], m.target_head)
    return m.eval()


def logits_of(out):
    return out.logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shapes_batch2(name):
    m = make(name)
    a = m.args
    S, N = 12, 3
    feats = torch.randn(2, S, len(a.target_layers) * TD)
    anchors = torch.tensor([[0, 4, 9], [2, 3, 10]])
    last = torch.randint(0, V, (2, N))
    out = m(feats, anchors, last)
    P = a.n_predict
    Vd = a.draft_vocab_size or V
    assert out.hidden.shape == (2, N, P, H)
    if a.model_type == "specblock":
        assert out.logits.shape == (2, N, P, Vd)
        assert out.rank_logits.shape == (2, N, P, len(a.rank_widths))
        toks, widths = m.propose(feats, anchors, last)
        assert toks.shape == (2, N, P) and widths.shape == (2, N, P)
    else:
        assert out.logits.shape == (2, N, a.n_categories, P, Vd)
        assert out.prior_logits.shape == (2, N, a.n_categories)
        toks, z = m.propose(feats, anchors, last, n_branches=2, z_temperature=1.0)
        assert toks.shape == (2, N, 2, P) and z.shape == (2, N, 2)
    assert int(toks.min()) >= 0 and int(toks.max()) < V
    # batch rows are independent: row 1 alone gives the same result
    solo = m(feats[1:], anchors[1:], last[1:])
    torch.testing.assert_close(logits_of(solo)[0], logits_of(out)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_anchors_equal_single_blocks(name):
    m = make(name)
    a = m.args
    feats = torch.randn(2, 10, len(a.target_layers) * TD)
    anchors = torch.tensor([[1, 5, 9], [0, 6, 8]])
    last = torch.randint(0, V, (2, 3))
    packed = logits_of(m(feats, anchors, last))
    for n in range(3):
        one = logits_of(m(feats, anchors[:, n:n + 1], last[:, n:n + 1]))
        torch.testing.assert_close(one[:, 0], packed[:, n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cache_matches_no_cache(name):
    m = make(name)
    a = m.args
    feats = torch.randn(2, 11, len(a.target_layers) * TD)
    last = torch.randint(0, V, (2, 3))
    full = logits_of(m(feats, torch.full((2, 1), 10), last[:, 2:]))
    cache = m.new_cache()
    m(feats[:, :4], torch.full((2, 1), 3), last[:, :1], cache=cache)        # prefill
    m(feats[:, 4:7], torch.full((2, 1), 6), last[:, 1:2], cache=cache)      # one block later
    inc = logits_of(m(feats[:, 7:], torch.full((2, 1), 10), last[:, 2:], cache=cache))
    assert cache.length == 11
    torch.testing.assert_close(inc, full, atol=1e-5, rtol=1e-5)
    # rollback: crop, then re-extend
    cache.crop(7)
    again = logits_of(m(feats[:, 7:], torch.full((2, 1), 10), last[:, 2:], cache=cache))
    torch.testing.assert_close(again, full, atol=1e-5, rtol=1e-5)


def test_model_type_table_rejects_unknown():
    with pytest.raises(ValueError, match="eagle9"):
        model_module("eagle9")
    with pytest.raises(ValueError, match="eagle9"):
        build_model({"model_type": "eagle9"})


def test_args_drop_unknown_keys():
    mod = model_module("specblock")
    args = mod.ModelArgs.from_dict(dict(CONFIGS["specblock"], lr=3e-4, not_a_field=1))
    assert args.dim == H and not hasattr(args, "not_a_field")


def test_layer_shift_moves_information_forward_only():
    m = make("specblock")
    x = torch.randn(1, 2, 4, H)
    y = m.shift[0](torch.cat([x, m.shift_prev(x)], -1))
    x2 = x.clone()
    x2[:, :, 1] = 0.0  # zero position k-1 = 1
    y2 = m.shift[0](torch.cat([x2, m.shift_prev(x2)], -1))
    assert not torch.allclose(y[:, :, 2], y2[:, :, 2])   # k = 2 sees k-1
    torch.testing.assert_close(y[:, :, 0], y2[:, :, 0])  # nothing flows backwards
    torch.testing.assert_close(y[:, :, 3], y2[:, :, 3])  # and only one step
    # whole drafter: perturbing block position j changes j+1.. but never positions < j
    feats = torch.randn(1, 6, 2 * TD)
    anchors, last = torch.tensor([[5]]), torch.tensor([[7]])
    base = m(feats, anchors, last).logits
    with torch.no_grad():
        m.pos_query[2].add_(1.0)
    moved = m(feats, anchors, last).logits
    torch.testing.assert_close(base[:, :, :2], moved[:, :, :2])
    assert not torch.allclose(base[:, :, 3], moved[:, :, 3])


def test_layer_shift_is_the_path_when_attention_is_blind():
    """With in-block attention removed (each row sees only the context), k still depends on k-1
    through the shift alone."""
    m = make("specblock")
    import blockspec.models.specblock as sb

    orig = sb.block_mask

    def ctx_only(anchors, n_ctx, P, causal):
        mk = orig(anchors, n_ctx, P, causal).clone()
        eye = torch.eye(mk.shape[-2], dtype=torch.bool)
        mk[..., n_ctx:] = eye
        return mk

    sb.block_mask = ctx_only
    try:
        feats = torch.randn(1, 6, 2 * TD)
        anchors, last = torch.tensor([[5]]), torch.tensor([[7]])
        base = m(feats, anchors, last).logits
        with torch.no_grad():
            m.pos_query[1].add_(1.0)
        moved = m(feats, anchors, last).logits
        assert not torch.allclose(base[:, :, 2], moved[:, :, 2])
        torch.testing.assert_close(base[:, :, 0], moved[:, :, 0])
        torch.testing.assert_close(base[:, :, 3], moved[:, :, 3])  # one layer shift = one step
    finally:
        sb.block_mask = orig


def test_dblast_branches_differ_and_kz1_is_plain():
    m = make("dblast_kz3")
    feats = torch.randn(1, 6, 2 * TD)
    out = m(feats, torch.tensor([[5]]), torch.tensor([[3]]))
    assert not torch.allclose(out.logits[:, :, 0], out.logits[:, :, 1])
    plain = make("dblast")
    assert plain.category_prior is None and plain.category_expander is None
    toks, z = plain.propose(feats, torch.tensor([[5]]), torch.tensor([[3]]), n_branches=3)
    assert (z == 0).all() and (toks == toks[:, :, :1]).all()


def test_checkpoint_state_excludes_target_weights():
    m = make("specblock")
    sd = m.state_dict()
    assert not any(k.startswith("target_") for k in sd)
    m2 = build_model(CONFIGS["specblock"])
    m2.load_state_dict(sd)


def test_resized_specblock_drafts_its_trained_positions_unchanged():
    """--init ... --block-size: a grown SpecBlock's first K positions draft what the K-block did
    (the block is causal), and a truncated one is the grown one's prefix."""
    m = make("specblock")
    a = m.args
    feats = torch.randn(1, 10, len(a.target_layers) * TD)
    anchors, last = torch.tensor([[2, 7]]), torch.randint(0, V, (1, 2))
    k4 = m(feats, anchors, last).logits
    m.resize_block(8)
    assert m.args.n_predict == 8 and m.pos_query.shape[0] == 8
    k8 = m(feats, anchors, last).logits
    torch.testing.assert_close(k8[:, :, :4], k4, atol=1e-5, rtol=1e-5)
    m.resize_block(2)
    torch.testing.assert_close(m(feats, anchors, last).logits, k8[:, :, :2], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["specblock", "dblast"])
def test_grown_drafter_drafts_what_it_did_then_learns(name):
    """--init ... --n-layer: appended layers start with zeroed outputs (and SpecBlock's shift before
    each as [I, 0]), so the grown drafter's logits are the trained one's; every new weight trains."""
    m = make(name)
    a = m.args
    feats = torch.randn(1, 10, len(a.target_layers) * TD)
    anchors, last = torch.tensor([[2, 7]]), torch.randint(0, V, (1, 2))
    before = m(feats, anchors, last).logits
    n0 = len(m.layers)
    m.grow_layers(n0 + 2)
    assert len(m.layers) == m.args.n_layer == n0 + 2
    assert name != "specblock" or len(m.shift) == n0 + 1
    out = m(feats, anchors, last).logits
    torch.testing.assert_close(out, before, atol=1e-5, rtol=1e-5)
    out.float().square().mean().backward()
    assert m.layers[-1].attn.wo.weight.grad.abs().sum() > 0
    assert m.layers[-1].ffn.down_proj.weight.grad.abs().sum() > 0
    m2 = build_model(dataclasses.asdict(m.args))
    m2.load_state_dict(m.state_dict())  # the grown shape round-trips through its own args
    with pytest.raises(ValueError, match="already has"):
        m.grow_layers(1)
    # --ffn-dim: wider FFNs whose new units' outputs start at zero, then train
    m.zero_grad()
    before = m(feats, anchors, last).logits
    ffn = m.args.ffn_dim
    m.grow_ffn(ffn + 24)
    assert all(layer.ffn.gate_proj.weight.shape[0] == ffn + 24 for layer in m.layers)
    out = m(feats, anchors, last).logits
    torch.testing.assert_close(out, before, atol=1e-5, rtol=1e-5)
    out.float().square().mean().backward()
    assert m.layers[0].ffn.down_proj.weight.grad[:, ffn:].abs().sum() > 0
    build_model(dataclasses.asdict(m.args)).load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match="already has"):
        m.grow_ffn(ffn)


@pytest.mark.parametrize("name", ["specblock", "dblast"])
def test_drafter_grown_to_more_taps_drafts_what_it_did_then_learns(name):
    """--init ... --target-layers: the new taps' fc columns start at zero (and their scale at one), so the
    grown drafter's logits are the trained one's on the old taps, whatever the new ones hold; the new
    columns train; the shape round-trips through its args; a list without the old taps is refused."""
    m = make(name)
    a = m.args
    old = [int(x) for x in a.target_layers]
    feats = torch.randn(1, 10, len(old) * TD)
    with torch.no_grad():
        m.feat_scale.uniform_(0.5, 2.0)  # a fitted scale follows its layer
    anchors, last = torch.tensor([[2, 7]]), torch.randint(0, V, (1, 2))
    before = m(feats, anchors, last).logits
    new = [max(old) + 2, max(old) + 1] + old[::-1]  # new taps first, the old ones reversed
    grown = m.grow_target_layers(new)
    assert grown == [lid for lid in new if lid not in old] and m.args.target_layers == new
    by_layer = {lid: feats[..., i * TD:(i + 1) * TD] for i, lid in enumerate(old)}
    wide = torch.cat([by_layer.get(lid, torch.randn(1, 10, TD)) for lid in new], -1)
    out = m(wide, anchors, last).logits
    torch.testing.assert_close(out, before, atol=1e-5, rtol=1e-5)
    assert all((m.layer_scale(lid) == 1).all() for lid in grown)
    out.float().square().mean().backward()
    assert m.fc.weight.grad[:, :len(grown) * TD].abs().sum() > 0
    m2 = build_model(dataclasses.asdict(m.args))
    m2.load_state_dict(m.state_dict())
    with pytest.raises(ValueError, match="expected every one"):
        m.grow_target_layers(new[1:])


def test_tau_by_block_reads_the_accepted_prefix_histogram():
    from blockspec.models.train import tau_by_block

    lengths = torch.randint(0, 9, (500,))
    t = tau_by_block(torch.bincount(lengths, minlength=9).tolist())
    assert list(t) == [1, 2, 4, 8]
    for b, tau in t.items():
        assert abs(tau - (1 + lengths.clamp(max=b).float().mean().item())) < 1e-4
