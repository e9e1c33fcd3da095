"""The GRPO maths of ``rl_loop.py``: group-relative advantages, the clipped policy-gradient loss,
the learner's log-probabilities of sampled completions in one padded forward, and one update.

Plain functions of tensors and token lists: nothing here knows about processes, the engine or
the loop's configuration.
"""

from __future__ import annotations

import torch


def token_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]],
                   token_ids: list[list[int]], temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, T]`` float32 log pi(token_ids[i][j]) = log_softmax(logits / temperature) and its
    0/1 mask (T = longest completion). One right-padded forward: padding sits after every real
    token, so causal attention never lets a real position see it."""
    device = next(model.parameters()).device
    seqs = [p + t for p, t in zip(prompt_ids, token_ids)]
    n, width = len(seqs), max(map(len, seqs))
    input_ids = torch.zeros(n, width, dtype=torch.long, device=device)
    attn = torch.zeros(n, width, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s, device=device)
        attn[i, : len(s)] = 1
    logits = model(input_ids=input_ids, attention_mask=attn).logits.float()
    t_max = max(map(len, token_ids))
    j = torch.arange(t_max, device=device)
    starts = torch.tensor([len(p) for p in prompt_ids], device=device)
    lens = torch.tensor([len(t) for t in token_ids], device=device)
    mask = (j[None, :] < lens[:, None]).float()
    # completion token j of row i sits at position len(prompt)+j, predicted by the logits one
    # position earlier; positions past the row's end are clamped and masked out.
    pos = (starts[:, None] - 1 + j[None, :]).clamp(max=width - 1)
    rows = logits.gather(1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))
    targets = input_ids.gather(1, (pos + 1).clamp(max=width - 1))
    logp = torch.log_softmax(rows / temperature, dim=-1).gather(2, targets[:, :, None])[..., 0]
    return logp * mask, mask


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each sample's reward minus its group's mean, over the group's (population) std + eps;
    a group whose samples all score the same gets advantage 0."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.flatten()


def grpo_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """-mean over completion tokens of min(ratio * A, clip(ratio, 1 +- eps) * A), ratio =
    exp(log pi_new - log pi_old). On-policy (one inner step) the ratio is 1 in value and its
    gradient is grad log pi_new, so this is the policy gradient; the clip only matters off
    policy."""
    ratio = torch.exp(new_logp - old_logp)
    a = adv.to(new_logp.device)[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    return -(surrogate * mask).sum() / mask.sum()


def padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    """``rows`` right-padded with zeros into a tensor of ``like``'s shape, dtype and device."""
    out = torch.zeros_like(like)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=out.dtype)
    return out


def grpo_step(model: torch.nn.Module, opt: torch.optim.Optimizer, prompt_ids: list[list[int]],
              token_ids: list[list[int]], old_logprobs: list[list[float]], rewards: list[float],
              *, temperature: float, group_size: int, clip_eps: float
              ) -> tuple[float, float, int]:
    """One GRPO update from sampled completions ``token_ids`` (consecutive groups of
    ``group_size`` per prompt) and the sampler's log-probabilities ``old_logprobs``; returns the
    loss, the largest |sampler - learner| logprob difference (before the update) and the number
    of tokens."""
    new_logp, mask = token_logprobs(model, prompt_ids, token_ids, temperature)
    old_logp = padded(old_logprobs, new_logp)
    max_diff = ((new_logp.detach() - old_logp).abs() * mask).max().item()
    loss = grpo_loss(new_logp, old_logp, group_advantages(rewards, group_size), mask, clip_eps)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item(), max_diff, int(mask.sum().item())
