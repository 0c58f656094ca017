"""Training pipeline on a tiny random target: feature cache round trip, overfit, checkpoint
rebuild + resume, the offline acceptance estimate, the CLI."""

import json

import numpy as np
import pytest

from blockspec.runtime.errors import BlockspecError

torch = pytest.importorskip("torch")

from blockspec.models import data, target as tgt  # noqa: E402
from fixtures_target import write_tiny_gguf  # noqa: E402
from blockspec.models.train import TrainConfig, accepted_lengths, check_config, load_drafter, train  # noqa: E402

TINY = dict(dim=48, n_layer=4, n_head=4, n_kv_head=2, head_dim=12, ffn_dim=64, vocab_size=97,
            rope_base=10000.0, norm_eps=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    path = d / "tiny-llama.gguf"
    write_tiny_gguf(path, tgt.ModelArgs(arch="llama", **TINY), seed=5)
    target = tgt.load_target(path)
    rng = np.random.default_rng(0)
    # a few repeated phrases so that the target's greedy continuations are learnable
    phrases = [list(rng.integers(3, 97, size=8)) for _ in range(4)]
    seqs = [[int(t) for _ in range(5) for t in phrases[rng.integers(0, 4)]] for _ in range(12)]
    cache = data.write_feature_cache(target, seqs, d / "cache", layers=[1, 2, 3], max_len=40,
                                     shard_size=5, batch_size=4, progress=False)
    return path, target, cache


def test_feature_cache_round_trip(tiny):
    path, target, cache = tiny
    meta, d = data.load_feature_cache(cache, [3, 1])
    assert meta["layers"] == [1, 2, 3] and len(sorted(cache.glob("shard_*"))) == 3
    assert d["feats"].shape == (12, 40, 2 * 48)
    toks = torch.from_numpy(d["tokens"][:1]).long()
    _, st = target(toks, layers=[1, 3])
    torch.testing.assert_close(torch.from_numpy(d["feats"][0, :, :48]).float(), st[3][0], atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="not cached"):
        data.load_feature_cache(cache, [0])


def test_json_array_stream_truncated():
    import io

    text = '[{"a": 1}, {"b": [1, 2]},\n {"c": "x' + "y" * 50
    assert list(data.iter_json_array(io.StringIO(text), chunk_size=7)) == [{"a": 1}, {"b": [1, 2]}]


def test_accepted_lengths_rule():
    draft = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4]])
    labels = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    data_next = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 7, 3, 4]])  # row 2 leaves the path at 1
    valid = torch.ones(3, 4, dtype=torch.bool)
    assert accepted_lengths(draft, labels, data_next, valid).tolist() == [4, 1, 2]


@pytest.mark.parametrize("method,extra", [("specblock", {}), ("dblast", dict(n_categories=3, loss="al")),
                                          ("specblock", dict(precision="bf16"))])
def test_overfit_checkpoint_resume(tiny, tmp_path, method, extra):
    path, target, cache = tiny
    cfg = TrainConfig(method=method, target=str(path), out=str(tmp_path / method), data=str(cache),
                      n_layer=1, draft_vocab_size=0, steps=60, batch_size=4, anchors_per_seq=8, lr=3e-3,
                      warmup=5, eval_every=60, eval_batches=2, save_every=30, log_every=1000,
                      heldout_frac=0.0, target_layers=[1, 3], **extra)
    before = None
    res = train(cfg, target=target, progress=False)
    meta = json.loads((tmp_path / method / "drafter.json").read_text())
    assert meta["step"] == 60 and meta["model_args"]["model_type"] == method
    assert meta["config"]["steps"] == 60
    # the tiny target's continuations are learnt (acceptance itself is capped near 1 here: a random
    # target's greedy tokens rarely follow the text, which stops the teacher-forced count)
    assert min(res["match_per_pos"]) > 0.5 and res["accept"] > 0.5, res
    model, _ = load_drafter(tmp_path / method, target)
    # resume: continuing to 70 steps starts from step 60
    cfg2 = TrainConfig(**{**cfg.__dict__, "steps": 70})
    train(cfg2, target=target, progress=False)
    assert json.loads((tmp_path / method / "drafter.json").read_text())["step"] == 70
    # fine-tune: --init starts a new run from the checkpoint's shape and weights, at step 0; a larger
    # --n-layer grows it (the new layers start as the identity), more --target-layers grow its input (the
    # new tap at zero weight, its feature scale fitted, the old taps' kept), a smaller --n-layer is refused
    init_args = json.loads((tmp_path / method / "drafter.json").read_text())["model_args"]
    wide = init_args["ffn_dim"] + 16
    ft = TrainConfig(**{**cfg.__dict__, "steps": 5, "out": str(tmp_path / "ft"), "init": str(tmp_path / method),
                        "n_layer": 3, "lr": 1e-9, "warmup": 0, "min_lr": 1e-9, "target_layers": [1, 2, 3],
                        "ffn_dim": wide})
    res_ft = train(ft, target=target, progress=False)
    tuned, meta_ft = load_drafter(tmp_path / "ft", target)
    assert meta_ft["step"] == 5
    assert meta_ft["model_args"] == {**init_args, "n_layer": 3, "target_layers": [1, 2, 3], "ffn_dim": wide}
    assert len(tuned.layers) == 3
    torch.testing.assert_close(tuned.layer_scale(1), model.layer_scale(1))
    torch.testing.assert_close(tuned.layer_scale(3), model.layer_scale(3))
    assert not torch.equal(tuned.layer_scale(2), torch.ones_like(tuned.layer_scale(2)))
    assert tuned.fc.weight[:, 48:96].abs().max() < 1e-3  # layer 2's columns: zero, moved by a 1e-9 rate
    assert res_ft["accept"] > 0.5, res_ft  # kept what the init learnt (grown, a tiny learning rate)
    shrink = TrainConfig(**{**ft.__dict__, "init": str(tmp_path / "ft"), "n_layer": 2, "out": str(tmp_path / "shrink")})
    with pytest.raises(BlockspecError, match="--n-layer 2: .* has 3 layers"):
        train(shrink, target=target, progress=False)
    narrow = TrainConfig(**{**ft.__dict__, "init": str(tmp_path / "ft"), "ffn_dim": 8, "out": str(tmp_path / "narrow")})
    with pytest.raises(BlockspecError, match=f"--ffn-dim 8: .* has {wide} FFN units"):
        train(narrow, target=target, progress=False)
    bad = TrainConfig(**{**ft.__dict__, "method": "dblast" if method == "specblock" else "specblock",
                         "out": str(tmp_path / "bad")})
    with pytest.raises(BlockspecError, match="drafter, not"):
        train(bad, target=target, progress=False)
    del before, model, tuned


def test_no_target_features_baseline_is_worse(tiny, tmp_path):
    path, target, cache = tiny
    common = dict(method="specblock", target=str(path), data=str(cache), n_layer=1, draft_vocab_size=0,
                  steps=60, batch_size=4, anchors_per_seq=8, lr=3e-3, warmup=5, eval_every=60,
                  eval_batches=2, save_every=1000, log_every=1000, heldout_frac=0.0, target_layers=[1, 3])
    with_f = train(TrainConfig(out=str(tmp_path / "f"), **common), target=target, progress=False)
    without = train(TrainConfig(out=str(tmp_path / "nf"), no_target_features=True, **common),
                    target=target, progress=False)
    assert with_f["match_per_pos"][0] > without["match_per_pos"][0]


def test_cli_help_and_options():
    from click.testing import CliRunner

    from blockspec.models.cli import train as group

    r = CliRunner().invoke(group, ["specblock", "--help"])
    assert r.exit_code == 0 and "--no-target-features" in r.output and "--anchors-per-seq" in r.output
    r = CliRunner().invoke(group, ["--help"])
    assert "dblast" in r.output and "features" in r.output
    # each method lists its own options (plus the common ones), every option with a help line
    spec, dbl = group.commands["specblock"], group.commands["dblast"]
    spec_opts = {o for p in spec.params for o in p.opts}
    dbl_opts = {o for p in dbl.params for o in p.opts}
    assert "--cross-block-weight" in spec_opts and "--cross-block-weight" not in dbl_opts
    assert "--n-categories" in dbl_opts and "--n-categories" not in spec_opts
    assert "--batch-size" in spec_opts & dbl_opts
    for cmd in group.commands.values():
        assert all(p.help for p in cmd.params), [p.name for p in cmd.params if not p.help]


def test_repick_vocab_keeps_trained_rows(tiny, tmp_path):
    """--init --repick-vocab: the draft vocabulary is re-picked from the data's labels; a token in both
    keeps its trained head row, a new one starts at the trained rows' mean plus half its target row."""
    from safetensors.torch import load_file, save_file

    path, target, cache = tiny
    cfg = TrainConfig(method="specblock", target=str(path), out=str(tmp_path / "a"), data=str(cache), n_layer=1,
                      draft_vocab_size=12, steps=20, batch_size=4, anchors_per_seq=8, lr=3e-3, warmup=2,
                      eval_every=20, eval_batches=2, save_every=1000, log_every=1000, heldout_frac=0.0,
                      target_layers=[1, 3])
    train(cfg, target=target, progress=False)
    # an older vocabulary: the trained one reversed, its 4 most frequent tokens swapped for unseen ids
    sd = load_file(str(tmp_path / "a" / "drafter.safetensors"))
    picked = sd["vocab.d2t"].clone()
    old = picked.flip(0).clone()
    old[-4:] = torch.tensor([t for t in range(TINY["vocab_size"]) if t not in picked.tolist()][:4])
    sd["vocab.d2t"], sd["vocab.lm_head.weight"] = old, sd["vocab.lm_head.weight"].flip(0).contiguous()
    save_file(sd, str(tmp_path / "a" / "drafter.safetensors"))
    rows = dict(zip(old.tolist(), sd["vocab.lm_head.weight"]))
    ft = TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "b"), "init": str(tmp_path / "a"), "steps": 1,
                        "lr": 1e-12, "warmup": 0, "min_lr": 1e-12, "repick_vocab": True})
    train(ft, target=target, progress=False)
    new = load_file(str(tmp_path / "b" / "drafter.safetensors"))
    assert sorted(new["vocab.d2t"].tolist()) == sorted(picked.tolist())  # the data's most frequent labels
    for i, tok in enumerate(new["vocab.d2t"].tolist()):
        want = rows[tok] if tok in rows else sd["vocab.lm_head.weight"].mean(0) + 0.5 * target.head_weight[tok]
        torch.testing.assert_close(new["vocab.lm_head.weight"][i], want.to(torch.float32), atol=1e-6, rtol=0)
    with pytest.raises(BlockspecError, match="--repick-vocab"):
        train(TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "c"), "repick_vocab": True}), target=target,
              progress=False)
    # --repick-size: a larger re-pick grows the head; the rows still follow their tokens, and a resumed
    # run loads its grown checkpoint
    grown = TrainConfig(**{**ft.__dict__, "out": str(tmp_path / "g"), "repick_size": 16})
    train(grown, target=target, progress=False)
    g = load_file(str(tmp_path / "g" / "drafter.safetensors"))
    assert g["vocab.d2t"].numel() == 16 and set(picked.tolist()) < set(g["vocab.d2t"].tolist())
    for i, tok in enumerate(g["vocab.d2t"].tolist()):
        want = rows[tok] if tok in rows else sd["vocab.lm_head.weight"].mean(0) + 0.5 * target.head_weight[tok]
        torch.testing.assert_close(g["vocab.lm_head.weight"][i], want.to(torch.float32), atol=1e-6, rtol=0)
    train(TrainConfig(**{**grown.__dict__, "steps": 2}), target=target, progress=False)
    assert load_file(str(tmp_path / "g" / "drafter.safetensors"))["vocab.d2t"].numel() == 16
    # averaged with its start: A's rows follow B's vocabulary, a token A lacks keeps B's row
    from blockspec.models.checkpoint import average_drafters

    g = load_file(str(tmp_path / "g" / "drafter.safetensors"))
    avg = load_file(str(average_drafters(tmp_path / "a", tmp_path / "g", tmp_path / "ag", 0.5) / "drafter.safetensors"))
    assert torch.equal(avg["vocab.d2t"], g["vocab.d2t"])
    for i, tok in enumerate(g["vocab.d2t"].tolist()):
        want = 0.5 * (rows[tok] + g["vocab.lm_head.weight"][i]) if tok in rows else g["vocab.lm_head.weight"][i]
        torch.testing.assert_close(avg["vocab.lm_head.weight"][i], want.to(torch.float32), atol=1e-6, rtol=0)
    with pytest.raises(BlockspecError, match="--repick-size"):
        train(TrainConfig(**{**ft.__dict__, "out": str(tmp_path / "h"), "repick_vocab": False, "repick_size": 16}),
              target=target, progress=False)
    for method, bad in (("specblock", -1), ("dblast", 1)):  # one line, nothing written
        with pytest.raises(BlockspecError, match=f"--block-size {bad}: expected at least"):
            train(TrainConfig(**{**cfg.__dict__, "method": method, "out": str(tmp_path / "d"), "block_size": bad}),
                  target=target, progress=False)
        assert not (tmp_path / "d").exists()


def _one_batch(tiny, method, extra=()):
    from blockspec.models import build_model
    from blockspec.models.train import Batches, make_model_args

    path, target, cache = tiny
    cfg = TrainConfig(method=method, target=str(path), data=str(cache), n_layer=1, draft_vocab_size=16,
                      batch_size=2, anchors_per_seq=4, target_layers=[1, 3], heldout_frac=0.0, **dict(extra))
    torch.manual_seed(0)
    model = build_model(make_model_args(cfg, target.args))
    model.bind_target(target.tok_embeddings.weight, target.head_weight)
    model.vocab.set_vocab(torch.arange(3, 19), target.head_weight)
    source = data.open_feature_cache(str(cache), [1, 3])
    span = 2 * model.args.n_predict if cfg.cross_block_weight else model.args.n_predict
    return cfg, model, Batches(source, model.args.n_predict, 0.0, seed=0).get_batch("train", 2, 4, span=span)


@pytest.mark.parametrize("method,extra", [("specblock", dict(distill_weight=0.5, cross_block_weight=0.5)),
                                          ("dblast", dict(n_categories=3, loss="al"))])
def test_training_step_stays_on_the_drafter_device(tiny, method, extra):
    """A training step (forward, every loss term, backward) on torch's meta device, which runs
    shapes only and refuses to mix devices: every tensor the step creates follows the drafter and
    the batch, so `--device cuda` has no host tensor left in the step."""
    from blockspec.models.train import loss_terms, to_device

    cfg, model, b = _one_batch(tiny, method, extra)
    model.to("meta")
    parts, _ = loss_terms(model, to_device(b, "meta"), cfg)
    loss = sum(parts.values())
    want = {"ce", "kd", "xb_ce"} if method == "specblock" else {"al", "nll"}
    assert loss.device.type == "meta" and want <= set(parts), parts
    loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters() if p.requires_grad)


def test_device_option_errors():
    from blockspec.models.common import resolve_device

    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(BlockspecError, match="--precision 'fp16': expected one of fp32, bf16"):
        check_config(TrainConfig(data="x", precision="fp16"))
    with pytest.raises(BlockspecError, match="--device 'gpu0': not a device"):
        resolve_device("gpu0")
    with pytest.raises(BlockspecError, match="--device mps: drafters train on cpu or cuda"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(BlockspecError, match="--device cuda: this torch .* sees no CUDA device"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) build of torch and a GPU")
@pytest.mark.parametrize("method,extra", [("specblock", dict(distill_weight=0.5, cross_block_weight=0.5)),
                                          ("dblast", dict(n_categories=3, loss="al"))])
def test_cuda_step_matches_cpu_and_checkpoints_move(tiny, tmp_path, method, extra):
    """On a GPU: the same step's loss terms and gradients as on the CPU (fp32; TF32 off here), and a
    run trained on the GPU resumes and loads on the CPU."""
    import copy

    from blockspec.models.train import loss_terms, to_device

    cfg, model, b = _one_batch(tiny, method, extra)
    gpu = copy.deepcopy(model).to("cuda")
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        p_cpu, _ = loss_terms(model, b, cfg)
        p_gpu, _ = loss_terms(gpu, to_device(b, "cuda"), cfg)
        sum(p_cpu.values()).backward()
        sum(p_gpu.values()).backward()
    finally:
        torch.set_float32_matmul_precision(prec)
    for k in p_cpu:
        torch.testing.assert_close(p_gpu[k].cpu(), p_cpu[k], rtol=1e-3, atol=1e-4)
    for (name, p), q in zip(model.named_parameters(), gpu.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-2, atol=1e-5, msg=name)
    path, target, cache = tiny
    run = TrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "g"), "steps": 10, "warmup": 2, "eval_every": 10,
                         "eval_batches": 2, "save_every": 5, "log_every": 1000, "device": "cuda"})
    train(run, target=target, progress=False)
    train(TrainConfig(**{**run.__dict__, "steps": 12, "device": "cpu"}), target=target, progress=False)
    assert json.loads((tmp_path / "g" / "drafter.json").read_text())["step"] == 12
    load_drafter(tmp_path / "g", target)
