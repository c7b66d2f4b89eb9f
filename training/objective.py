"""Token-alignable training (TAT): a rollout of K forward passes per batch, and the losses that score it.

Positions (EAGLE's shift): position ``t`` reads token ``x_{t+1}`` and feature ``F_t``; it regresses ``F_{t+1}`` and
predicts the target's distribution ``p_{t+1} = softmax(LM(F_{t+1}))`` of the token after ``x_{t+1}``.

Pass 1 reads target features everywhere (EAGLE training). Pass ``k`` reads, at position ``t``, the *version* ``k-1``
input: the regress feature pass ``k-1`` produced at ``t-1`` (detached). Its query at ``t`` attends to the key at
``s = t - d`` of version ``max(k-1-d, 0)``, i.e. the simulated drafting chain of the last ``k-1`` positions on top of
target features. The loss of pass ``k+1`` keeps position ``t`` only if pass ``k`` kept ``t-1`` and the true next token
was in pass ``k``'s top-``topk`` there (the alignment mask): the position is then on a branch the draft tree contains.

Training-time test (EAGLE-3, ``ttt=True``) is the same unroll over ``L`` passes with three differences: the fed-back
features keep their gradient (the head learns to read its own outputs), a position counts wherever its label is an
assistant token whose target argmax is in the draft vocabulary (the chain before it may run through the prompt; with
``topk`` the alignment mask still drops chains that left the tree), and pass ``i+1`` weighs ``0.8**i`` with no feature
loss. EAGLE-3 indexes step ``i`` by the chain's first position (tokens shifted left by ``i``, diagonal attention to
its own earlier steps); here pass ``i+1`` at ``t`` is that step at ``t-i``: the same attention, RoPE position and
labels (docs/design.md, "Training-time test").

:class:`Rollout` runs the passes and returns, per pass, the draft's logits and features, the kept positions and the
target's soft labels (:class:`PassOutput`; or, for a head with its own lm_head trained by soft-CE, that loss itself,
scored without the [N, V] logits), computed at the kept positions only (pass 1 still attends over every
position: each is a key of the later passes); :class:`HeadLoss` scores one pass with a token objective of
``training.losses`` plus the feature regression; :class:`AdaSpecSelector` narrows the positions a loss trains on.
:class:`MultiPassObjective` composes them, so a new objective is a new loss or selector, not a new trainer.

Shapes: B batch, T positions, H hidden, V draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from griffin.draft import DraftModel
from griffin.progress import progress as progress_bar

from .losses import LinearSoftCrossEntropy, TokenLoss, adaspec_select, make_token_loss, per_token_fkl


def chain_attention(q: torch.Tensor, keys0: torch.Tensor, values0: torch.Tensor, chain_keys: torch.Tensor,
                    chain_values: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """Attention of draft-chain queries: a query sees the version-0 keys (pass 1's, from the target's features) at
    positions up to ``limit``, where its chain starts, and then its own chain's keys, one per later version (the
    diagonal attention): ``T + C`` keys per query, where concatenating every version's keys behind a mask would
    cost ``(C + 1) * T``.

    The prefix runs in one fused ``scaled_dot_product_attention`` call, so its [Tq, T] scores and probabilities are
    never materialised. The chain joins it as one extra key per query: each query gets an extra dimension holding
    its chain's log-sum-exp, read by a sentinel key that is 1 there, so the sentinel takes exactly the chain's share
    of the softmax; its value (1 in the extra dimension) returns that share, which weighs the chain's own attention
    output. The same function as one softmax over ``T + C`` scores, and its gradient. (The extra dimensions are 8,
    seven of them zeros, and the key heads are repeated per query head, so that a GPU's memory-efficient kernel can
    take the masked call; a CPU's fused kernel needs neither.)

    q [B, nh, Tq, D]; keys0 / values0 [B, nkv, T, D]; chain_keys / chain_values [B, nkv, Tq, C, D]; limit [B, Tq]
    -> [B, nh, Tq, D]. Query head ``i`` reads key head ``i // (nh / nkv)``, as transformers' grouped attention.
    """
    b, nh, tq, d = q.shape
    nkv, t = keys0.shape[1], keys0.shape[2]
    scale = d**-0.5
    # [B, nkv, g, Tq, C] the chain's scores, and its own attention output
    chain = torch.einsum("bngqd,bnqcd->bngqc", q.view(b, nkv, -1, tq, d), chain_keys).float() * scale
    chain_out = torch.einsum("bngqc,bnqcd->bngqd", chain.softmax(-1).to(chain_values.dtype), chain_values)
    lse = chain.logsumexp(-1).reshape(b, nh, tq, 1)  # [B, nh, Tq, 1] the sentinel's score
    # E = 8 extra dimensions, the first used, the rest zeros, and the key heads repeated per query head: what the
    # memory-efficient GPU kernel needs (D + E a multiple of 8, no grouped heads) to take a masked call
    e = 8
    sentinel = F.pad(keys0.new_ones(b, nkv, 1, 1), (d, e - 1))  # [B, nkv, 1, D + E]: 1 at the extra dimension d
    q = torch.cat((q, F.pad((lse / scale).to(q.dtype), (0, e - 1))), dim=-1)  # [B, nh, Tq, D + E]
    keys = torch.cat((F.pad(keys0, (0, e)), sentinel), dim=2).repeat_interleave(nh // nkv, 1)  # [B, nh, T + 1, D + E]
    values = torch.cat((F.pad(values0, (0, e)), sentinel), dim=2).repeat_interleave(nh // nkv, 1)
    allowed = torch.arange(t + 1, device=q.device) <= limit[..., None]  # [B, Tq, T + 1]
    allowed[..., t] = True  # the sentinel: every query has a chain
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed[:, None], scale=scale)
    return out[..., :d] + out[..., d : d + 1] * chain_out.reshape(b, nh, tq, d)


def next_masks(mask: torch.Tensor, aligned: torch.Tensor, data_mask: torch.Tensor) -> torch.Tensor:
    """``m^(k+1)_t = m^(k)_{t-1} * a^(k)_{t-1} * data_mask_t`` with ``m^(k+1)_0 = 0``; all [B, T] 0/1 floats."""
    carried = torch.zeros_like(mask)
    carried[:, 1:] = mask[:, :-1] * aligned[:, :-1]
    return carried * data_mask


def ahead(mask: torch.Tensor, span: int) -> torch.Tensor:
    """[B, T] 0/1 -> 1 where ``mask`` is 1 at ``t`` or at any of the ``span`` positions after it."""
    padded = torch.nn.functional.pad(mask, (0, span))
    return padded.unfold(1, span + 1, 1).amax(-1)


@dataclass
class Batch:
    """A padded training batch built from stored features (see :func:`make_batch`)."""

    tokens: torch.Tensor  # [B, T] x_{t+1}: the token position t reads
    features: torch.Tensor  # [B, T, H] F_t (fused heads: [B, T, 3H], the inputs of three target layers at t)
    targets: torch.Tensor  # [B, T, H] F_{t+1} (the last hidden state: soft labels, feature regression)
    next_tokens: torch.Tensor  # [B, T] x_{t+2} (the true next token; -1 where unknown)
    data_mask: torch.Tensor  # [B, T] 1 where x_{t+1} is an assistant token
    valid: torch.Tensor  # [B, T] bool, False on padding
    target_argmax: torch.Tensor | None = None  # [B, T] the target's top token after x_{t+1}, when the store has it

    def to(self, device) -> Batch:
        return Batch(*(None if (x := getattr(self, f)) is None else x.to(device) for f in self.__dataclass_fields__))

    @property
    def num_tokens(self) -> int:
        return int(self.valid.sum())


def make_batch(items, max_len: int | None = None, fused: bool = False) -> Batch:
    """Conversations (input_ids [L], loss_mask [L], hidden [L, H], and with ``fused`` layers [L, 3H]) -> a
    right-padded :class:`Batch` of L-1 positions."""
    cut = [(c.input_ids[:max_len], c.loss_mask[:max_len], c.hidden[:max_len],
            (c.layers if fused else c.hidden)[:max_len]) for c in items]
    width = max(len(ids) for ids, *_ in cut) - 1
    hsize, fsize = cut[0][2].shape[-1], cut[0][3].shape[-1]
    b = len(cut)
    tokens = torch.zeros(b, width, dtype=torch.long)
    next_tokens = torch.full((b, width), -1, dtype=torch.long)
    features = torch.zeros(b, width, fsize)
    targets = torch.zeros(b, width, hsize)
    data_mask = torch.zeros(b, width)
    valid = torch.zeros(b, width, dtype=torch.bool)
    known = fused and all(c.argmax is not None for c in items)
    target_argmax = torch.zeros(b, width, dtype=torch.long) if known else None
    for i, (ids, mask, hidden, read) in enumerate(cut):
        n = len(ids) - 1
        tokens[i, :n] = ids[1:]
        next_tokens[i, : n - 1] = ids[2:]
        features[i, :n] = read[:-1].float()
        targets[i, :n] = hidden[1:].float()
        data_mask[i, :n] = mask[1:].float()
        valid[i, :n] = True
        if target_argmax is not None:
            target_argmax[i, :n] = items[i].argmax[1 : n + 1]
    return Batch(tokens, features, targets, next_tokens, data_mask, valid, target_argmax)


def batch_members(draft: DraftModel, batch: Batch) -> torch.Tensor | None:
    """[V_target] 0/1: the static draft vocabulary plus every token of the batch, for a head with a context vocabulary
    (the columns a batch's logits need; :class:`Rollout` narrows them per position); None for other heads."""
    if draft.draft_vocab is None or not draft.config.context_vocab:
        return None
    device = batch.tokens.device
    member = torch.zeros(draft.config.vocab_size, device=device)
    member[draft.static_vocab().to(device)] = 1
    member[batch.tokens[batch.valid]] = 1
    member[batch.next_tokens[batch.next_tokens >= 0]] = 1
    return member


def first_seen(tokens: torch.Tensor, valid: torch.Tensor, to_local: torch.Tensor, static: torch.Tensor,
               size: int) -> torch.Tensor:
    """tokens [B, T] (target ids, position t reads x_{t+1}), valid [B, T] -> [B, V]: the first position whose token is
    each of the V local draft tokens, per conversation; -1 for the static draft vocabulary (always proposable), T for
    never. ``to_local`` maps target ids to local indices (-1: not in the batch vocabulary)."""
    b, t = tokens.shape
    local = torch.where(valid, to_local[tokens], size)  # [B, T]; padding goes to a spill column
    local = torch.where(local >= 0, local, size)
    seen = torch.full((b, size + 1), t, dtype=torch.long, device=tokens.device)
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    seen.scatter_reduce_(1, local, positions, reduce="amin")
    seen = seen[:, :size]
    static = to_local[static]
    seen[:, static[static >= 0]] = -1
    return seen


class PassOutput(NamedTuple):
    """What one pass of the rollout produced, at the N positions the pass keeps (``rows``, flat indices into B*T
    where ``mask`` is 1). The others are outside every loss and every report, and no later pass reads them, so the
    rollout computes nothing there (a quarter of ShareGPT's positions are not the assistant's, and the alignment mask
    drops more at every later pass)."""

    logits: torch.Tensor | None  # [N, V] fp32 draft logits, -inf on tokens not proposable there (None: token_loss)
    target_logits: torch.Tensor | None  # [N, V] fp32 target logits LM(F_{t+1}), -inf alike (the labels' support)
    rows: torch.Tensor  # [N] flat positions b*T + t of the kept positions, ascending
    predict: torch.Tensor  # [N, H]
    regress: torch.Tensor  # [N, H]
    mask: torch.Tensor  # [B, T] 0/1: positions on a branch the draft tree contains (pass 1: the data mask)
    hit1: torch.Tensor  # [B, T] 0/1: the true next token is the draft's top-1 (0 outside the mask)
    hitk: torch.Tensor  # [B, T] 0/1: ... is among its top report_k (0 outside the mask)
    token_loss: torch.Tensor | None = None  # [N] fp32 soft-CE against the target, when the rollout scored it

    def row_of(self, b: int, t: int) -> int | None:
        """Index into ``logits`` / ``target_logits`` / ``token_loss`` of position (b, t); None if the pass does not
        keep it."""
        flat = b * self.mask.shape[1] + t
        i = int(torch.searchsorted(self.rows, flat))
        return i if i < len(self.rows) and int(self.rows[i]) == flat else None


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """values [N] at flat ``rows`` -> a [B, T] tensor of ``shape``, 0 elsewhere."""
    return torch.zeros(shape.numel(), dtype=values.dtype, device=values.device).index_copy_(0, rows, values).view(shape)


class QueryLayout(NamedTuple):
    """The kept positions of a pass, conversation by conversation: slot j of conversation b is position
    ``index[b, j]``; ``used`` marks real slots (a conversation with fewer kept positions is padded with position 0)."""

    index: torch.Tensor  # [B, Tq] positions
    used: torch.Tensor  # [B, Tq] bool; ``x[used]`` lists the slots in ``rows`` order

    @classmethod
    def of(cls, rows: torch.Tensor, b: int, t: int) -> QueryLayout:
        conv = rows // t
        counts = torch.bincount(conv, minlength=b)
        slot = torch.arange(len(rows), device=rows.device) - (counts.cumsum(0) - counts)[conv]
        width = max(int(counts.max()) if len(rows) else 0, 1)
        index = torch.zeros(b, width, dtype=torch.long, device=rows.device)
        used = torch.zeros(b, width, dtype=torch.bool, device=rows.device)
        index[conv, slot] = rows % t
        used[conv, slot] = True
        return cls(index, used)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, ...] -> [B, Tq, ...] at the slots' positions."""
        return x.gather(1, self.index.view(*self.index.shape, *[1] * (x.dim() - 2)).expand(-1, -1, *x.shape[2:]))

    def scatter(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """x [B, n, Tq, D] (keys or values of the slots) -> [B, n, T, D], zeros at the positions without a slot."""
        b, n, _, d = x.shape
        out = x.new_zeros(b, t, n, d)
        out[self.used.nonzero(as_tuple=True)[0], self.index[self.used]] = x.transpose(1, 2)[self.used]
        return out.transpose(1, 2)


class Rollout:
    """The K passes of token-alignable training over a batch, with their versions and alignment masks.

    What a position may propose is what the drafting engine could propose there. A head with a context vocabulary
    (``griffin.vocab``) proposes its static tokens plus the tokens of the context so far; pass ``k`` at position
    ``t`` simulates the ``k``-th draft step of a tree whose context ends at token ``x_{t-k+2}`` (read at position
    ``t-k+1``), so the tokens its conversation showed up to there are proposable and the others get ``-inf`` logits
    and no soft-label mass. A true next token that is not proposable is a miss, for accuracy and alignment alike.
    """

    def __init__(self, draft: DraftModel, steps: int, topk: int, noise: float = 0.2, ttt: bool = False):
        if steps < 1:
            raise ValueError("steps must be at least 1")
        if topk < 0:
            raise ValueError("topk must be >= 0 (0 = no token mask)")
        self.draft, self.steps, self.topk, self.noise, self.ttt = draft, steps, topk, noise, ttt
        self.report_k = topk or 3  # the top-k accuracy reported (HASS, without a token mask, still reports top-3)

    def noisy(self, features: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Training-time uniform feature noise ``(U(0,1) - 0.5) * noise * 512 / T``."""
        if self.noise <= 0:
            return features
        u = torch.rand(features.shape, generator=generator, device=features.device, dtype=features.dtype)
        return features + (u - 0.5) * self.noise * 512 / features.shape[1]

    def __call__(self, batch: Batch, vocab: torch.Tensor | None = None, features: torch.Tensor | None = None,
                 masks: list[torch.Tensor] | None = None, soft_ce: bool = False) -> list[PassOutput]:
        """``vocab``: target ids the head may propose (default: its static draft vocabulary); ``features``: the
        pass-1 input features (default: the batch's, without noise); ``masks``: the kept positions of each pass,
        instead of this head's own alignment masks (AdaSPEC scores a reference head on the draft's positions).
        ``soft_ce``: a head with its own lm_head and no context vocabulary scores each pass's soft cross-entropy
        here (:class:`~training.losses.LinearSoftCrossEntropy`, ``PassOutput.token_loss``) instead of returning its
        [N, V] logits and labels (None then): the same loss and hits, without the fp32 [N, V] passes."""
        draft = self.draft
        b, t = batch.tokens.shape
        device = batch.tokens.device
        position_ids = torch.arange(t, device=device)[None].expand(b, t)
        vocab = draft.static_vocab().to(device) if vocab is None else vocab
        weight = draft.lm_weight_full()[vocab]  # [V, H] frozen lm_head rows of the proposable tokens
        data_mask = batch.data_mask * batch.valid
        to_local = torch.full((draft.config.vocab_size,), -1, dtype=torch.long, device=device)
        to_local[vocab] = torch.arange(vocab.shape[0], device=device)
        # [N1]: every pass computes a subset of these (TTT: of every real position, a chain may start in the prompt)
        data_rows = (batch.valid.float() if self.ttt else data_mask).flatten().nonzero().squeeze(1)
        label_row = torch.full((b * t,), -1, dtype=torch.long, device=device)
        label_row[data_rows] = torch.arange(len(data_rows), device=device)
        with torch.no_grad():  # [N1, V]
            target_logits = draft.logits_transform(F.linear(batch.targets.flatten(0, 1)[data_rows], weight)).float()
            counted = self.counted(batch, data_mask, data_rows, to_local, vocab.shape[0]) if self.ttt else data_mask
        gt = torch.where(batch.next_tokens >= 0, to_local[batch.next_tokens.clamp(min=0)], -1).flatten()  # -1: absent
        seen = None
        if draft.draft_vocab is not None and draft.config.context_vocab:
            seen = first_seen(batch.tokens, batch.valid, to_local, draft.static_vocab().to(device), vocab.shape[0])
        scored = soft_ce and draft.lm_head is not None and seen is None
        if scored:
            probs = F.softmax(target_logits, dim=-1)  # [N1, V], shared by every pass's rows
            del target_logits  # only the probabilities are read from here on: one [N1, V] fp32 tensor, not two
        features = batch.features if features is None else features
        # TAT: the kept positions, which are also the computed ones; TTT: the chains still alive (in the tree)
        mask = (batch.valid.float() if self.ttt else data_mask) if masks is None else masks[0]
        keys, values, passes = [], [], []
        for k in range(1, self.steps + 1):
            # TTT computes a live chain while a counted label lies within the passes left to it
            compute = mask * ahead(counted, self.steps - k) if self.ttt else mask
            rows = compute.flatten().nonzero().squeeze(1)  # [N]
            slots = QueryLayout.of(rows, b, t)
            if k == 1:  # every position's key (version 0) and attention; the MLP at the kept positions
                # causal attention without a mask: padding is on the right, after every real query
                out = draft.forward_fused(draft.fuse(batch.tokens, features), position_ids, queries=slots.index)
                keys.append(out.key)
                values.append(out.value)
            else:  # the kept positions only: a kept position's chain was kept at every earlier pass
                inputs = features.new_zeros(*slots.index.shape, features.shape[-1])  # [B, Tq, H]
                inputs[slots.used] = features.flatten(0, 1)[rows - 1]  # the previous pass's regress at t-1
                h = draft.fuse(slots.take(batch.tokens), inputs)
                out = draft.forward_fused(h, slots.index, attention=self.chain(slots.index, k, keys, values))
                if k < self.steps:
                    keys.append(slots.scatter(out.key, t))
                    values.append(slots.scatter(out.value, t))
            predict, regress = out.predict[slots.used], out.regress[slots.used]  # [N, H] in rows order
            gt_k, logits, labels, token_loss = gt[rows], None, None, None
            if scored:
                token_loss, ranked = LinearSoftCrossEntropy.apply(predict, draft.lm_head.weight, probs,
                                                                  label_row[rows], self.report_k)
            else:
                if draft.lm_head is not None:  # the head's own lm_head over its draft vocabulary (fused archs)
                    logits = draft.lm_head(predict).float()  # [N, V]
                else:
                    logits = draft.logits_transform(F.linear(predict, weight.to(predict.dtype))).float()  # [N, V]
                labels = target_logits if len(rows) == len(data_rows) else target_logits[label_row[rows]]
                if seen is not None:
                    context_end = (rows % t - (k - 1)).split(torch.bincount(rows // t, minlength=b).tolist())
                    # [N, V]: a conversation at a time, so that seen [B, V] is never copied per position
                    blocked = torch.cat([seen[i] > end[:, None] for i, end in enumerate(context_end)])
                    logits = logits.masked_fill(blocked, -torch.inf)
                    labels = labels.masked_fill(blocked, -torch.inf)
                    gt_k = torch.where(blocked.gather(-1, gt_k.clamp(min=0)[:, None])[:, 0], -1, gt_k)
                ranked = logits.detach().topk(min(self.report_k, logits.shape[-1]), dim=-1).indices  # [N, k]
            with torch.no_grad():
                hit1 = scatter_rows((ranked[:, 0] == gt_k).float(), rows, mask.shape)
                hitk = scatter_rows((ranked == gt_k[:, None]).any(-1).float(), rows, mask.shape)
            passes.append(PassOutput(logits, labels, rows, predict, regress, mask * counted if self.ttt else mask,
                                     hit1, hitk, token_loss))
            if k < self.steps:
                aligned = hitk if self.topk else torch.ones_like(hitk)  # topk 0: no token mask (HASS)
                if masks is not None:
                    mask = masks[k]
                else:
                    mask = next_masks(compute, aligned, batch.valid.float() if self.ttt else data_mask)
                fed = regress if self.ttt else regress.detach()  # TTT learns through its own outputs
                # [B, T, H], zeros where not computed
                features = fed.new_zeros(b * t, fed.shape[-1]).index_copy(0, rows, fed).view(b, t, -1)
        return passes

    @staticmethod
    def chain(index: torch.Tensor, k: int, keys: list[torch.Tensor], values: list[torch.Tensor]):
        """Pass ``k``'s attention at positions ``index`` [B, Tq]: the query at ``t`` simulates draft step ``k`` of the
        chain that starts after position ``t-k+1``; it sees version 0 up to there, version ``j`` (``keys[j]``,
        [B, nkv, T, D] at the positions pass ``j+1`` computed) at ``t-k+1+j`` and its own new key (version k-1)."""
        def attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
            nkv, d = k_new.shape[1], k_new.shape[-1]
            at = [(index - (k - 1 - j)).clamp(min=0)[:, None, :, None].expand(-1, nkv, -1, d) for j in range(1, k - 1)]
            chain_keys = torch.stack([keys[j].gather(2, i) for j, i in enumerate(at, 1)] + [k_new], dim=3)
            chain_values = torch.stack([values[j].gather(2, i) for j, i in enumerate(at, 1)] + [v_new], dim=3)
            return chain_attention(q, keys[0], values[0], chain_keys, chain_values, index - (k - 1))

        return attention

    def counted(self, batch: Batch, data_mask: torch.Tensor, data_rows: torch.Tensor, to_local: torch.Tensor,
                proposable_size: int) -> torch.Tensor:
        """[B, T] 0/1: the positions a TTT loss counts, assistant tokens whose target argmax (over the whole
        vocabulary) the head can propose; a head over the whole vocabulary counts every assistant token."""
        if proposable_size == to_local.shape[0]:  # no host sync: the caller knows how many ids it may propose
            return data_mask
        if batch.target_argmax is not None:  # stored with the features (build_features --feature-layers)
            best = batch.target_argmax.flatten()[data_rows]
        else:  # [N1]: the whole lm_head, a large product, once per batch
            best = F.linear(batch.targets.flatten(0, 1)[data_rows], self.draft.lm_weight_full()).argmax(-1)
        proposable = torch.zeros(data_mask.numel(), device=data_mask.device)
        proposable[data_rows] = (to_local[best] >= 0).float()
        return data_mask * proposable.view_as(data_mask)


class HeadLoss:
    """``w_regress * SmoothL1(regress, F_{t+1}) + w_token * token_loss(p, q)`` summed over a pass's kept positions."""

    def __init__(self, token_loss: TokenLoss, w_regress: float = 1.0, w_token: float = 0.1):
        self.token_loss, self.w_regress, self.w_token = token_loss, w_regress, w_token

    def __call__(self, out: PassOutput, regress_targets: torch.Tensor,
                 keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (loss sum, number of positions) over the pass's kept positions (narrowed to ``keep`` [N] bool, over
        ``out.rows``, if given; a TTT pass computes more rows than its loss counts)."""
        mask = out.mask.flatten()[out.rows]  # [N]
        if keep is not None:
            mask = mask * keep.float()
        scored = out.token_loss is not None  # the rollout's soft-CE at temperature 1 (finite on every row)
        loss = self.w_token * (out.token_loss if scored else self.token_loss(out.target_logits, out.logits, mask))
        if self.w_regress:
            loss = loss + self.w_regress * F.smooth_l1_loss(
                out.regress.float(), regress_targets.flatten(0, 1)[out.rows], reduction="none").mean(-1)
        return (loss * mask).sum(), mask.sum()


class AdaSpecSelector:
    """AdaSPEC: per pass, keep the ``frac`` of kept positions where the draft's per-token FKL exceeds a frozen
    reference head's the most (``Δ = L_draft − L_ref``); the reference runs its own rollout on the same inputs and
    positions."""

    def __init__(self, reference: DraftModel, steps: int, frac: float):
        if not 0 < frac <= 1:
            raise ValueError(f"the selected fraction must be in (0, 1], got {frac}")
        self.rollout, self.frac = Rollout(reference, steps, topk=0, noise=0), frac

    @torch.no_grad()
    def __call__(self, batch: Batch, vocab: torch.Tensor | None, features: torch.Tensor,
                 passes: list[PassOutput]) -> list[torch.Tensor]:
        """-> per pass, bool [N] over its kept positions (``PassOutput.rows``): the ones to train on."""
        reference = self.rollout(batch, vocab, features, masks=[out.mask for out in passes])
        keep = []
        for out, ref in zip(passes, reference, strict=True):
            delta = per_token_fkl(out.target_logits, out.logits) - per_token_fkl(ref.target_logits, ref.logits)
            keep.append(adaspec_select(delta, torch.ones_like(delta), self.frac))
        return keep


class MultiPassObjective(nn.Module):
    """Rollout + loss (+ token selection) around a draft head; ``forward(batch)`` returns per-pass sums and counts.

    ``loss_sums`` / ``counts``: the loss summed over the positions it trains on and their number (the training loss is
    ``sum(pass_weights * loss_sums / counts)``); ``kept``: positions on
    a branch the tree contains (the alignment mask), over which ``top1`` / ``topk`` hits are summed. The caller divides
    by the (globally reduced) counts so that the gradient equals the mean over the global batch however it is split
    across processes. The selector narrows only the training loss; validation scores every kept position.
    """

    def __init__(self, draft: DraftModel, steps: int, topk: int, w_regress: float = 1.0, w_token: float = 0.1,
                 noise: float = 0.2, token_loss: TokenLoss | None = None, reference: DraftModel | None = None,
                 select_frac: float = 0.4, ttt: bool = False):
        super().__init__()
        if ttt and reference is not None:
            raise ValueError("AdaSPEC token selection does not run with training-time test yet: drop --select")
        self.draft = draft
        self.rollout = Rollout(draft, steps, topk, noise, ttt=ttt)
        # TTT: the token loss alone, pass i+1 weighted 0.8**i (EAGLE-3); TAT: the mean over passes
        self.loss = HeadLoss(token_loss or make_token_loss("soft-ce"), 0.0 if ttt else w_regress,
                             1.0 if ttt else w_token)
        weights = [0.8**i for i in range(steps)] if ttt else [1 / steps] * steps
        self.register_buffer("pass_weights", torch.tensor(weights), persistent=False)
        self.reference = reference  # registered, so that it follows the objective's device
        # the rollout scores the soft-CE itself where the loss is that at temperature 1 (and no selector reads logits)
        self.soft_ce = (self.loss.token_loss.name, self.loss.token_loss.temperature) == ("soft-ce", 1.0) and \
            reference is None
        self.selector = AdaSpecSelector(reference.requires_grad_(False).eval(), steps, select_frac) \
            if reference is not None else None

    @property
    def steps(self) -> int:
        return self.rollout.steps

    @property
    def report_k(self) -> int:
        return self.rollout.report_k

    def forward(self, batch: Batch, vocab: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """``vocab``: target ids the head may propose for this batch (default: its static draft vocabulary)."""
        features = self.rollout.noisy(batch.features, generator) if self.training else batch.features
        passes = self.rollout(batch, vocab, features, soft_ce=self.soft_ce)
        keep = self.selector(batch, vocab, features, passes) if self.selector and self.training else [None] * len(
            passes)
        sums, counts = zip(*(self.loss(out, batch.targets, k) for out, k in zip(passes, keep)), strict=True)
        return {"loss_sums": torch.stack(sums), "counts": torch.stack(counts),
                "kept": torch.stack([out.mask.sum() for out in passes]),
                "top1": torch.stack([(out.hit1 * out.mask).sum() for out in passes]),
                "topk": torch.stack([(out.hitk * out.mask).sum() for out in passes])}


@torch.no_grad()
def score_store(objective: MultiPassObjective, store, indices: list[int], batch_size: int, max_len: int | None,
                device: torch.device, autocast=None, progress: bool = True) -> torch.Tensor:
    """Validation totals of ``objective`` (in eval mode) over conversations ``indices`` of a feature store:
    [5, K] rows loss sums, loss counts, kept positions, top-1 hits, top-k hits (sum them across processes, then
    :func:`pass_report`). ``autocast``: a context-manager factory (training's mixed precision), or None."""
    from contextlib import nullcontext

    totals = torch.zeros(5, objective.steps, device=device)
    for b in progress_bar(range(0, len(indices), batch_size), desc="validate", disable=not progress, leave=False):
        batch = make_batch(store.items(indices[b : b + batch_size]), max_len, objective.draft.config.fused)
        batch = batch.to(device)
        member = batch_members(objective.draft, batch)
        vocab = None if member is None else member.nonzero().squeeze(1)
        with (autocast or nullcontext)():
            out = objective(batch, vocab)
        totals += torch.stack([out["loss_sums"], out["counts"], out["kept"], out["top1"], out["topk"]]).float()
    return totals


def pass_report(totals: torch.Tensor, report_k: int) -> list[dict]:
    """[5, K] totals (:func:`score_store`) -> per pass: loss, top-1, top-k and kept (a fraction of pass 1's positions);
    None where nothing was measured (never reported as 0)."""
    sums, counts, kept, top1, topk = totals.tolist()

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return [{"pass": k + 1, "loss": ratio(sums[k], counts[k]), "top1": ratio(top1[k], kept[k]),
             f"top{report_k}": ratio(topk[k], kept[k]), "kept": ratio(kept[k], kept[0]), "positions": int(kept[k])}
            for k in range(len(sums))]
