"""A minimal generation loop over the model's own cache: prefill once, then one token per step.

The inference engine (batching, paged FP4 cache, CED bounded replay) is a separate package; this loop is
the reference it is checked against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.model.transformer import Transformer


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] fp32 -> token ids [B]. temperature 0 is greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.inference_mode()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
) -> torch.Tensor:
    """prompt [B, S] int64 -> generated ids [B, <= max_new_tokens] (stops early when all rows hit eos)."""
    if prompt.ndim != 2 or prompt.size(1) == 0:
        raise ValueError("prompt must be a non-empty [batch, seq] tensor")
    if max_new_tokens <= 0:
        return prompt.new_empty(prompt.size(0), 0)
    b, s = prompt.shape
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = model.new_cache(b, s + max_new_tokens)
    logits = model(prompt.to(model.device), 0, cache, last_only=True)[:, -1]
    out, done = [], torch.zeros(b, dtype=torch.bool)
    for step in range(max_new_tokens):
        token = sample_next(logits.float().cpu(), temperature, top_p, gen)
        if eos_id is not None:
            token = torch.where(done, eos_id, token)
            done |= token == eos_id
        out.append(token)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = model(token.view(b, 1).to(model.device), s + step, cache, last_only=True)[:, -1]
    return torch.stack(out, dim=1)


# ---------------------------------------------------------------------- speculative decoding (DSpark)
@dataclass
class SpeculativeStats:
    """What a speculative run did: target forwards (verify steps), drafted and accepted tokens, and how
    often the draft at each block position was accepted (`accepted_at[i]`: steps whose draft i+1 was)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_at: list[int] = field(default_factory=list)
    verified_at: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per target forward (plain decoding: 1)."""
        return self.emitted / max(self.steps, 1)


def _filtered_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution `sample_next` draws from: softmax(logits / T) restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _snapshot(cache, n_layers: int) -> dict:
    """The cache state a forward overwrites in place below the positions it writes: window rings (slot =
    position % window) and partial compression groups. Entries past the accepted position (compressed KV,
    index keys, Engram history) are never read before they are written again, so they need no copy."""
    return {
        "window": [cache.window_kv[i].clone() for i in range(n_layers)],
        "group_kv": {k: v.clone() for k, v in cache.group_kv.items()},
        "group_score": {k: v.clone() for k, v in cache.group_score.items()},
    }


def _restore(cache, snapshot: dict) -> None:
    for i, ring in enumerate(snapshot["window"]):
        cache.window_kv[i].copy_(ring)
    for k, v in snapshot["group_kv"].items():
        cache.group_kv[k].copy_(v)
    for k, v in snapshot["group_score"].items():
        cache.group_score[k].copy_(v)


@torch.inference_mode()
def generate_speculative(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_id: int | None = None,
    seed: int = 0,
    confidence_threshold: float = 0.0,
    stats: SpeculativeStats | None = None,
    cache=None,
) -> torch.Tensor:
    """`generate` with DSpark draft-and-verify (spec §12b): per step the drafter proposes k tokens, one
    target forward over [token, draft] scores them, the longest valid prefix is kept plus one token from
    the target. Greedy output equals `generate`'s under the same numerics (use batch-invariant GEMMs,
    `model.numerics(16)`: the target then scores a token the same inside a block as alone); with
    temperature > 0 the tokens follow the target's distribution (standard speculative sampling: accept
    draft d with probability min(1, p(d) / q(d)), else sample from norm(max(p - q, 0))).

    Rows advance in lockstep (the fewest accepted tokens of the batch); rejected positions are rolled
    back by restoring what the verify forward overwrote and re-running the accepted tokens.
    confidence_threshold > 0: verify only the leading draft positions whose running product of predicted
    acceptance (sigmoid of the confidence head) stays above it. cache: a fresh `ModelCache` to use (for
    inspection), at least prompt + max_new_tokens + k + 1 long.
    """
    if not len(model.mtp):
        raise ValueError("this model has no DSpark drafter (config n_mtp_layers / dspark_block_size)")
    if prompt.ndim != 2 or prompt.size(1) == 0:
        raise ValueError("prompt must be a non-empty [batch, seq] tensor")
    stats = stats if stats is not None else SpeculativeStats()
    if max_new_tokens <= 0:
        return prompt.new_empty(prompt.size(0), 0)
    k = model.cfg.dspark_block_size
    stats.accepted_at = stats.accepted_at or [0] * k
    stats.verified_at = stats.verified_at or [0] * k
    b, s = prompt.shape
    device = model.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    greedy = temperature <= 0
    cache = cache if cache is not None else model.new_cache(b, s + max_new_tokens + k + 1)
    inputs: dict = {}
    logits = model(prompt.to(device), 0, cache, last_only=True, drafter_inputs=inputs)[:, -1]
    model.draft_prefill(inputs["main_hidden"], 0, cache)
    hidden = inputs["main_hidden"][:, -1:]
    pos = s - 1  # the last position the backbone has processed
    token = sample_next(logits.float().cpu(), temperature, top_p, gen).to(device)  # position pos + 1
    out = [token]

    def choose(row: torch.Tensor) -> torch.Tensor:
        return sample_next(row.float().cpu(), temperature, top_p, gen).to(device)

    while len(out) < max_new_tokens:
        if eos_id is not None and bool((torch.stack(out, 1) == eos_id).any(1).all()):
            break
        draft = model.draft(token, hidden, pos, cache, choose=choose)
        n = k
        if confidence_threshold > 0:
            likely = torch.sigmoid(draft.confidence).cumprod(-1) >= confidence_threshold  # [B, k]
            n = max(1, int(likely.sum(-1).max()))
        n = min(n, max_new_tokens - len(out) - 1)  # never run past the last token asked for
        proposed = draft.tokens[:, 1 : n + 1]  # [B, n]: positions pos + 2 ..
        feed = torch.cat([token.unsqueeze(1), proposed], dim=1)  # positions pos + 1 .. pos + n + 1
        saved = _snapshot(cache, model.cfg.n_layers)
        inputs = {}
        target = model(feed, pos + 1, cache, drafter_inputs=inputs)  # [B, n + 1, V] fp32
        accepted, nxt = _accept(target, draft.logits[:, :n], proposed, temperature, top_p, gen, greedy)
        stats.steps += 1
        stats.drafted += b * n
        for i in range(n):
            stats.verified_at[i] += b
            stats.accepted_at[i] += int((accepted > i).sum())
        a = int(accepted.min())  # lockstep: rows that accepted more keep their draft token at `a`
        if a < n:
            nxt = torch.where(accepted > a, proposed[:, a], nxt)
        stats.accepted += b * a
        if a < n:  # roll back the rejected positions: restore, then run the accepted tokens again
            _restore(cache, saved)
            inputs = {}
            model(feed[:, : a + 1], pos + 1, cache, last_only=True, drafter_inputs=inputs)
        if a:  # the drafter's rings get every accepted backbone row; the last one is written by draft()
            model.draft_prefill(inputs["main_hidden"][:, :a], pos + 1, cache)
        hidden = inputs["main_hidden"][:, a : a + 1]
        out.extend(proposed[:, i] for i in range(a))
        out.append(nxt)
        pos += a + 1
        token = nxt
    tokens = torch.stack(out, dim=1)
    if eos_id is not None:  # as `generate`: eos repeats after a row's first one; stop when every row has one
        hit = (tokens == eos_id).int().cumsum(1) > 0
        tokens = torch.where(hit, eos_id, tokens)
        done_at = hit.all(0).nonzero()
        if len(done_at):
            tokens = tokens[:, : int(done_at[0]) + 1]
    stats.emitted += tokens.size(1)
    return tokens


def _accept(
    target: torch.Tensor,
    draft_logits: torch.Tensor,
    proposed: torch.Tensor,
    temperature: float,
    top_p: float,
    gen: torch.Generator,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """target [B, n + 1, V] (logits at the fed positions), draft_logits [B, n, V] (what each proposal was
    drawn from), proposed [B, n] -> (accepted drafts per row [B], the target's token after them [B])."""
    b, n = proposed.shape
    if greedy:
        choice = target.argmax(-1)  # [B, n + 1]
        accepted = (proposed == choice[:, :n]).int().cumprod(-1).sum(-1)
        return accepted, choice.gather(1, accepted.unsqueeze(1)).squeeze(1)
    accepted = torch.full((b,), n, dtype=torch.long)
    nxt = torch.empty(b, dtype=torch.long)
    for row in range(b):
        for i in range(n):
            p = _filtered_probs(target[row, i].cpu(), temperature, top_p)
            q = _filtered_probs(draft_logits[row, i].cpu(), temperature, top_p)
            d = int(proposed[row, i])
            if float(torch.rand((), generator=gen)) * float(q[d]) < float(p[d]):
                continue
            residual = (p - q).clamp_min(0)
            residual = residual / residual.sum() if float(residual.sum()) > 0 else p
            accepted[row] = i
            nxt[row] = torch.multinomial(residual, 1, generator=gen)
            break
        else:
            nxt[row] = torch.multinomial(_filtered_probs(target[row, n].cpu(), temperature, top_p), 1, generator=gen)
    return accepted.to(proposed.device), nxt.to(proposed.device)
