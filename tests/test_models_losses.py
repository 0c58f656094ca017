"""Each drafter loss against a brute-force computation on a toy case."""

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from blockspec.models import losses  # noqa: E402
from blockspec.models.specblock import rank_bucket_labels  # noqa: E402


def test_block_ce_prefix_mask_matches_loop_and_stops_gradients():
    torch.manual_seed(0)
    R, P, V = 5, 4, 7
    logits = torch.randn(R, P, V, requires_grad=True)
    labels = torch.randint(0, V, (R, P))
    labels[0] = logits[0].argmax(-1)          # row 0 all correct
    labels[1, 0] = logits[1, 0].argmax(-1)    # row 1: first right, then force a miss at 1
    labels[1, 1] = (logits[1, 1].argmax(-1) + 1) % V
    valid = torch.ones(R, P, dtype=torch.bool)
    valid[2, 3] = False
    w = losses.position_weights(P, 2.0)
    loss, keep = losses.block_cross_entropy(logits, labels, valid, prefix_mask=True, decay_gamma=2.0)
    num = den = 0.0
    for r in range(R):
        for k in range(P):
            if not valid[r, k]:
                break
            ce = -torch.log_softmax(logits[r, k], -1)[labels[r, k]]
            num, den = num + w[k] * ce, den + w[k]
            assert keep[r, k]
            if logits[r, k].argmax() != labels[r, k]:
                break
    torch.testing.assert_close(loss, num / den)
    loss.backward()
    # after the first error in row 1 (position 1) no gradient reaches positions 2, 3
    assert logits.grad[1, 1].abs().sum() > 0
    assert logits.grad[1, 2:].abs().sum() == 0
    assert logits.grad[0].abs().sum() > 0


def test_prefix_keep_undraftable_label_is_an_error():
    correct = torch.tensor([[True, False, True]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert losses.prefix_keep(correct, valid).tolist() == [[True, True, False]]


def test_rank_labels_and_loss():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, 20)
    labels = torch.randint(0, 20, (3, 4))
    labels[0, 0] = -1
    widths = [1, 2, 4, 8]
    b = rank_bucket_labels(logits, labels, widths)
    for i in range(3):
        for k in range(4):
            if labels[i, k] < 0:
                assert b[i, k] == 3
                continue
            rank = sorted(logits[i, k].tolist(), reverse=True).index(logits[i, k, labels[i, k]].item())
            expect = next((j for j, w in enumerate(widths) if rank < w), 3)
            assert b[i, k] == expect
    rl = torch.randn(3, 4, 4)
    keep = torch.rand(3, 4) > 0.3
    got = losses.rank_bucket_cross_entropy(rl, b, keep)
    ref = torch.stack([torch.nn.functional.cross_entropy(rl[i, k], b[i, k]) for i in range(3) for k in range(4)
                       if keep[i, k]]).mean()
    torch.testing.assert_close(got, ref)


def _enumerate_accept_length(q, p):
    """E[accepted length] by enumerating all drafted blocks x ~ prod q_i and rejection sampling
    against independent p_i (acceptance prob of each prefix is the product of min(1, p/q))."""
    P, V = q.shape
    total = 0.0
    for xs in itertools.product(range(V), repeat=P):
        prob = math.prod(q[i, x].item() for i, x in enumerate(xs))
        acc, run = 0.0, 1.0
        for i, x in enumerate(xs):
            run *= min(1.0, p[i, x].item() / q[i, x].item())
            acc += run
        total += prob * acc
    return total


def test_acceptance_identity_and_surrogate_brute_force():
    torch.manual_seed(2)
    P, V = 3, 3
    q = torch.softmax(torch.randn(P, V), -1)
    p = torch.softmax(torch.randn(P, V), -1)
    brute = _enumerate_accept_length(q, p)
    # identity: E_{x~q}[accepted] = sum_k prod_i sum_y p(y) min(1, q(y)/p(y)), via all label blocks y ~ p
    est = 0.0
    for ys in itertools.product(range(V), repeat=P):
        py = math.prod(p[i, y].item() for i, y in enumerate(ys))
        y = torch.tensor(ys)
        e = losses.expected_acceptance(q.log()[torch.arange(P), y][None], p.log()[torch.arange(P), y][None],
                                       torch.ones(1, P, dtype=torch.bool))
        est += py * e.item()
    # est is E_y[prod estimate] = E[A] because positions are independent
    assert abs(est - brute) < 1e-6
    # surrogate with tau = 0 is -log of the estimate
    y = torch.tensor([[0, 2, 1]])
    lq = q.log()[torch.arange(P), y[0]][None]
    lp = p.log()[torch.arange(P), y[0]][None]
    valid = torch.ones(1, P, dtype=torch.bool)
    got = losses.acceptance_surrogate(lq, lp, valid, tau=0.0)
    a = torch.minimum(torch.ones(P), (lq - lp).exp()[0])
    ref = -math.log(a[0] + a[0] * a[1] + a[0] * a[1] * a[2])
    assert abs(got.item() - ref) < 1e-5


def test_acceptance_surrogate_truncation_and_mixture():
    lq = torch.log(torch.tensor([[0.5, 0.0001, 0.9, 0.9]]))
    lp = torch.log(torch.tensor([[0.8, 0.9, 0.9, 0.5]]))
    valid = torch.ones(1, 4, dtype=torch.bool)
    a = torch.minimum(torch.ones(4), (lq - lp).exp()[0])
    # r_2 = 1.1e-4 < tau: prefixes 3 and 4 are dropped, prefix 2 (ending at the failing one) kept
    got = losses.acceptance_surrogate(lq, lp, valid, tau=1e-3)
    assert abs(got.item() + math.log(a[0] + a[0] * a[1])) < 1e-5
    # mixture: -log sum_z pi_z E[A|z]
    lqz = torch.log(torch.tensor([[[0.5, 0.5, 0.5, 0.5], [0.9, 0.1, 0.9, 0.9]]]))
    prior = torch.tensor([[0.3, -0.2]])
    pi = torch.softmax(prior[0], -1)
    ref = 0.0
    for z in range(2):
        az = torch.minimum(torch.ones(4), (lqz[0, z] - lp[0]).exp())
        ref += pi[z] * torch.cumprod(az, 0).sum()
    got = losses.acceptance_surrogate(lqz, lp, valid, tau=0.0, prior_logits=prior)
    assert abs(got.item() + math.log(ref.item())) < 1e-5
    # invalid positions do not count
    v2 = torch.tensor([[True, True, False, False]])
    got = losses.acceptance_surrogate(lq, lp, v2, tau=0.0)
    assert abs(got.item() + math.log(a[0] + a[0] * a[1])) < 1e-5
    # a row whose first label is undraftable (log q = -inf) adds 0 to the mean and no gradient
    lq2 = torch.stack([lq[0], lq[0].clone().index_fill_(0, torch.tensor([0]), -math.inf)]).requires_grad_()
    got = losses.acceptance_surrogate(lq2, lp.expand(2, 4), valid.expand(2, 4), tau=1e-3)
    assert abs(got.item() + math.log(a[0] + a[0] * a[1]) / 2) < 1e-5
    got.backward()
    assert torch.isfinite(lq2.grad).all() and (lq2.grad[1] == 0).all()


def test_mixture_nll_brute_force():
    torch.manual_seed(3)
    Kz, P, V = 3, 2, 4
    logits = torch.randn(1, Kz, P, V)
    prior = torch.randn(1, Kz)
    labels = torch.tensor([[1, 3]])
    valid = torch.ones(1, P, dtype=torch.bool)
    got = losses.mixture_nll(logits, prior, labels, valid)
    pi = torch.softmax(prior[0], -1)
    q = torch.softmax(logits[0], -1)
    lik = sum(pi[z] * q[z, 0, 1] * q[z, 1, 3] for z in range(Kz))
    assert abs(got.item() + math.log(lik.item()) / 2) < 1e-5


def test_distill_kl_brute_force():
    torch.manual_seed(4)
    V = 6
    dl = torch.randn(2, V)
    ids = torch.tensor([[0, 3, 5], [1, 2, -1]])
    tl = torch.log_softmax(torch.randn(2, 3), -1)
    keep = torch.tensor([True, True])
    got = losses.distill_kl(dl, ids, tl, keep, temperature=0.7)
    tot = 0.0
    for r in range(2):
        p = torch.softmax(tl[r] / 0.7, -1) * (ids[r] >= 0)
        p = p / p.sum()
        lq = torch.log_softmax(dl[r], -1)
        tot += sum(p[j] * (p[j].log() - lq[ids[r, j]]) for j in range(3) if ids[r, j] >= 0)
    assert abs(got.item() - tot.item() / 2) < 1e-5
