"""Training losses of the block drafters. Pure functions: tensors in, scalar loss (and counts) out.

Shapes: leading dims `...` are rows (B, N), P = predicted positions per block, V = draft vocab.
`labels` are draft-vocabulary ids (-1: the token is outside the draft vocabulary, which can never
be drafted, so it counts as an error). `valid` [..., P] marks positions that exist in the data.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def prefix_keep(correct: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Valid-prefix mask: position k is kept iff it exists and every earlier position was drafted
    correctly. The first wrong position is kept (it is the one to fix); everything after it is not,
    because the verifier stops there and never sees it. correct/valid [..., P] bool -> [..., P]."""
    ok = (correct & valid).to(torch.int64)
    before = torch.cumprod(F.pad(ok, (1, 0), value=1)[..., :-1], dim=-1).bool()
    return before & valid


def position_weights(P: int, decay_gamma: float | None, device=None) -> torch.Tensor:
    """DFlash's position decay w_k = exp(-k / gamma) (k = 0 for the first drafted token): early
    positions matter more, since a later one only counts if all before it were accepted."""
    k = torch.arange(P, dtype=torch.float32, device=device)
    return torch.ones(P, device=device) if not decay_gamma else torch.exp(-k / decay_gamma)


def block_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                        prefix_mask: bool = True, decay_gamma: float | None = None):
    """Cross-entropy of a block. logits [..., P, V], labels [..., P], valid [..., P].
    With `prefix_mask`, positions after the first wrong greedy draft get no loss (and so no
    gradient). Returns (mean loss over kept positions, kept mask [..., P])."""
    logits = logits.float()
    safe = labels.clamp_min(0)
    ce = F.cross_entropy(logits.flatten(0, -2), safe.flatten(), reduction="none").view(labels.shape)
    has = valid & (labels >= 0)
    if prefix_mask:
        correct = logits.argmax(-1) == labels
        keep = prefix_keep(correct, valid)
    else:
        keep = valid.clone()
    w = position_weights(labels.shape[-1], decay_gamma, logits.device) * (keep & has)
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    return loss, keep


def cross_block_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, shift: int,
                              prefix_mask: bool = True, decay_gamma: float | None = None):
    """Cross-entropy of the cross-block term (SpecBlock's block-level training-time test).

    Block 1 is anchored at t and drafts x[t+2..t+1+P] from the target's conditioning c[t]. Block 2
    is anchored at t + shift (1 <= shift <= P; shift = P chains the blocks end to end): its last
    token is the text's x[t+shift+1] (teacher forcing, as for block 1), its conditioning is block
    1's final state at slot shift-1 (the state that drafted x[t+shift+1]) instead of
    c[t+shift], which does not exist when block 2 is drafted, and it predicts x[t+shift+2 ..].
    `labels`/`valid` [..., shift + P] are the span from position t+1 on (the same rows block 1's
    [..., :P] come from); block 2 scores [..., shift:shift+P] of them. Its own valid-prefix mask
    applies inside it; it is not gated on block 1 being right (as in the paper's code: a drafter
    that chains blocks at serving time does so exactly when block 1 is uncertain).
    logits [..., P, V] of block 2. Returns (mean loss over kept positions, kept mask [..., P])."""
    P = logits.shape[-2]
    if not 1 <= shift <= P or labels.shape[-1] < shift + P:
        raise ValueError(f"cross-block shift {shift} needs 1 <= shift <= {P} and {shift + P} labels "
                         f"(got {labels.shape[-1]})")
    return block_cross_entropy(logits, labels[..., shift:shift + P], valid[..., shift:shift + P],
                               prefix_mask, decay_gamma)


def rank_bucket_cross_entropy(rank_logits: torch.Tensor, buckets: torch.Tensor, keep: torch.Tensor):
    """Rank-head cross-entropy on the positions the verifier reaches. rank_logits [..., P, nb],
    buckets [..., P] (see specblock.rank_bucket_labels), keep [..., P] bool."""
    ce = F.cross_entropy(rank_logits.float().flatten(0, -2), buckets.flatten(), reduction="none")
    w = keep.flatten().float()
    return (ce * w).sum() / w.sum().clamp_min(1e-6)


def gather_logp(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log q(label) [..., P] from logits [..., P, V]; -inf where label < 0 (not draftable)."""
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return logp.masked_fill(labels < 0, -math.inf)


def acceptance_surrogate(draft_logp: torch.Tensor, target_logp: torch.Tensor, valid: torch.Tensor,
                         tau: float = 1e-3, prior_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Acceptance-length surrogate loss (threshold-truncated, log domain), mean over rows.

    Derivation. Stochastic verification (Leviathan et al. 2023) accepts a drafted x_i ~ q_i with
    probability min(1, p_i(x_i) / q_i(x_i)) and stops at the first rejection, so the accepted
    length of a block of P is A = sum_k 1[x_1..x_k all accepted] and, treating positions as
    conditionally independent given the prefix (teacher forcing),
        E[A] = sum_{k=1}^P prod_{i<=k} alpha_i,   alpha_i = sum_x min(q_i(x), p_i(x)).
    Since sum_x min(q, p) = E_{y~p}[min(1, q(y)/p(y))], one target-distributed token y_i per
    position (the training label, drawn from p) gives an unbiased per-position estimate
        a_i = min(1, r_i),   r_i = q_i(y_i) / p_i(y_i),
    so E[A] ~= sum_k prod_{i<=k} a_i = sum_k exp(S_k),  S_k = sum_{i<=k} min(0, log r_i).
    We minimise -log E[A] = -logsumexp_k S_k, computed in the log domain: the products underflow
    early in training, when q and p barely overlap, and the log keeps the gradient finite (while
    every r_i is tiny it reduces to the NLL of position 1, the natural warm start). The threshold
    truncation drops prefix k once an earlier ratio r_i < tau: that prefix is practically
    unreachable, its terms only add importance-weight noise, and dropping it mirrors the
    valid-prefix mask of the NLL loss. With tau = 0 the loss is exactly -log of the estimate.
    Only positions with q_i(y_i) < p_i(y_i) get a gradient (min(1, .) is flat above 1): raising q
    beyond p cannot raise the acceptance probability. Not an unbiased estimator of -log E[A] nor
    a bound (log of a sum of estimates); a practical training signal, as the DBlast write-up says.

    Mixture drafters (DBlast, Kz categories): E[A] = sum_z pi_z E[A | z], so the loss is
    -logsumexp_z (log pi_z + logsumexp_k S_k^z), with S^z from q(. | z).

    draft_logp: log q_i(y_i) [..., P] or [..., Kz, P] with prior_logits [..., Kz];
    target_logp: log p_i(y_i) [..., P] (the target at the sampling temperature); valid [..., P].
    """
    if prior_logits is None:
        draft_logp, prior_logits = draft_logp[..., None, :], None
    # [..., Kz, P] log r_i; an undraftable label (-inf) becomes a very small finite ratio
    lr = (draft_logp.float() - target_logp.float()[..., None, :]).clamp_min(-1e4)
    log_a = lr.clamp_max(0.0)
    v = valid[..., None, :].expand_as(lr)
    ok = v & (lr >= math.log(tau) if tau > 0 else torch.ones_like(v))
    kept = prefix_keep(ok, v)  # prefix k kept iff all i < k passed the threshold
    S = torch.cumsum(log_a.masked_fill(~v, 0.0), dim=-1)
    S = S.masked_fill(~kept, -1e4)  # finite: an all-dropped row must not give NaN gradients
    per_z = torch.logsumexp(S, dim=-1)  # [..., Kz] log E[A | z]
    if prior_logits is not None:
        per_z = per_z + F.log_softmax(prior_logits.float(), dim=-1)
    logE = torch.logsumexp(per_z, dim=-1)  # [...]
    # a row whose first label is undraftable sits at the -1e4 floor with no gradient: it adds 0, not
    # 1e4, so the logged loss stays readable (the divisor, hence every gradient, is unchanged)
    logE = logE.masked_fill(logE < -1e3, 0.0)
    has = valid.any(-1)  # the mean over rows with a label, without a host sync (0 when none has one)
    return -logE.masked_fill(~has, 0.0).sum() / has.sum().clamp_min(1)


def expected_acceptance(draft_logp, target_logp, valid) -> torch.Tensor:
    """The plain estimate sum_k prod_{i<=k} min(1, r_i) [...] (no truncation, no log)."""
    a = (draft_logp.float() - target_logp.float()).clamp_max(0.0).exp() * valid
    return torch.cumprod(a, dim=-1).sum(-1)


def mixture_nll(logits: torch.Tensor, prior_logits: torch.Tensor, labels: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
    """-log sum_z q(z|y) prod_j q_j(y_j | y, z) per row, over valid positions, divided by the number
    of valid tokens. logits [..., Kz, P, V], prior_logits [..., Kz], labels/valid [..., P]."""
    lq = gather_logp(logits, labels[..., None, :].expand(logits.shape[:-1]))  # [..., Kz, P]
    lq = lq.masked_fill(~valid[..., None, :], 0.0).clamp_min(-1e4)  # undraftable: big finite loss
    joint = torch.logsumexp(F.log_softmax(prior_logits.float(), -1) + lq.sum(-1), dim=-1)
    return -joint.sum() / valid.sum().clamp_min(1)


def distill_kl(draft_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logp: torch.Tensor,
               keep: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(p_T || q) against the target's distribution at `temperature`, from its top-k ids/log-probs
    (renormalised over the top-k; ids < 0 are outside the draft vocabulary and dropped).
    draft_logits [..., V], teacher_ids/logp [..., k], keep [...] bool -> mean over kept rows."""
    p = F.softmax(teacher_logp.float() / temperature, dim=-1).masked_fill(teacher_ids < 0, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-12)
    lq = F.log_softmax(draft_logits.float(), dim=-1).gather(-1, teacher_ids.clamp_min(0))
    kl = (p * (torch.log(p.clamp_min(1e-12)) - lq)).sum(-1)
    w = keep.float()
    return (kl * w).sum() / w.sum().clamp_min(1e-6)
