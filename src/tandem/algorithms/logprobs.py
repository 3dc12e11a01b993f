"""Log-probabilities of chosen tokens without materialising a [N, vocab] log-softmax.

The output projection and the log-softmax are fused and chunked: the forward keeps only the
per-token log-sum-exp, the backward recomputes each chunk's logits (like a fused linear
cross-entropy), so peak memory is chunk_size x vocab instead of num_tokens x vocab.
"""

from __future__ import annotations

import torch


class _LinearTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[target], computed chunk by chunk; with
    `with_entropy` also each token's entropy (a second output, without gradient; else empty)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_size: int, with_entropy: bool):
        num_tokens = hidden.shape[0]
        out = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(num_tokens if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            _chunked_forward(
                hidden, weight, targets, temperature, chunk_size, out, lse, entropy if with_entropy else None
            )
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx, grad_out, grad_entropy):
        with torch.autocast(grad_out.device.type, enabled=False):
            return (*_chunked_backward(ctx, grad_out), None)


def _chunked_forward(hidden, weight, targets, temperature, chunk_size, out, lse, entropy) -> None:
    buffer = _logits_buffer(hidden, weight, chunk_size)
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        logits = _scaled_logits(hidden[start:end], weight, temperature, buffer)  # [n, V]
        out[start:end] = logits.gather(1, targets[start:end, None]).squeeze(1)
        # log-sum-exp in place (torch.logsumexp would allocate another [n, V])
        peak = logits.amax(dim=-1)
        if entropy is None:
            lse[start:end] = peak + logits.sub_(peak[:, None]).exp_().sum(dim=-1).log_()
        else:
            lse[start:end] = peak + _entropy_in_place(logits, peak, entropy[start:end])
        out[start:end] -= lse[start:end]


def _entropy_in_place(logits: torch.Tensor, peak: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
    """Write each row's entropy H = log S - sum_v e_v d_v / S into `entropy`, with d = z - max z,
    e = exp(d), S = sum_v e_v (= -sum p log p, p = e / S); returns log S. Overwrites `logits`, in
    place as the log-sum-exp does: xlogy(e, e) = e d, and 0 where e underflows."""
    exps = logits.sub_(peak[:, None]).exp_()
    total = exps.sum(dim=-1)
    log_total = total.log()
    entropy.copy_(log_total - exps.xlogy_(exps).sum(dim=-1) / total)
    return log_total


def _logits_buffer(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """One [chunk, V] fp32 buffer that every chunk of a call reuses: a fresh 50 MB tensor per
    chunk is above glibc's mmap threshold, so each was a new mapping faulted in page by page
    (measured: 0.3 M fewer page faults per 4 training micro-batches of the embedded model)."""
    rows = min(chunk_size, hidden.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=torch.float32, device=hidden.device)


def _scaled_logits(
    h: torch.Tensor, weight: torch.Tensor, temperature: float, buffer: torch.Tensor
) -> torch.Tensor:
    # logits in fp32 whatever the weight's dtype: a bf16 logit of 20 is off by ~0.04, which
    # would show up directly in the importance ratio
    logits = buffer[: h.shape[0]]
    if weight.dtype == torch.float32 and h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=logits)
    else:
        logits.copy_(h @ weight.t())
    return logits if temperature == 1.0 else logits.div_(temperature)


def _chunked_backward(ctx, grad_out):
    hidden, weight, targets, lse = ctx.saved_tensors
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_hidden = torch.zeros_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
    buffer = _logits_buffer(hidden, weight, ctx.chunk_size)
    for start in range(0, hidden.shape[0], ctx.chunk_size):
        end = min(start + ctx.chunk_size, hidden.shape[0])
        h = hidden[start:end]
        # d log p[target] / d logits = onehot(target) - softmax(logits), built in place: each
        # [n, V] temporary is 50 MB at the embedded model's vocabulary
        g = _scaled_logits(h, weight, ctx.temperature, buffer).sub_(lse[start:end, None]).exp_()
        g.mul_(-grad_out[start:end, None])
        g.scatter_add_(1, targets[start:end, None], grad_out[start:end, None].float())
        if ctx.temperature != 1.0:
            g.div_(ctx.temperature)
        g = g.to(hidden.dtype)
        if need_hidden:
            torch.mm(g, weight, out=grad_hidden[start:end])
        if need_weight:
            if g.dtype == torch.float32:
                grad_weight.addmm_(g.t(), h)  # no [V, H] temporary per chunk
            else:
                grad_weight.add_((g.t() @ h).float())
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature) at `targets`.

    hidden [N, H], weight [V, H] (the output embedding), targets [N] -> [N] float32.
    Differentiable in hidden and weight; never holds more than chunk_size x V logits (256 x 49,152
    fp32 = 50 MB for the embedded model; the matmul is as fast at 256 rows as at 1024 on a CPU).
    `return_entropy`: also each token's entropy -sum_v p_v log p_v of the same (tempered) softmax,
    [N] float32, from the same chunks (no extra [N, V]); it carries no gradient (for logging).
    """
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    logprobs, entropy = _LinearTokenLogprobs.apply(
        hidden, weight, targets, float(temperature), int(chunk_size), bool(return_entropy)
    )
    return (logprobs, entropy) if return_entropy else logprobs


def logits_token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """The straightforward reference: log_softmax(logits / T) gathered at targets. [..., V] -> [...]."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(policy || reference) per token, >= 0 (GRPO's and PPO's penalty):
    exp(logp_ref - logp) - (logp_ref - logp) - 1, elementwise over [B, T]."""
    ref_diff = ref_logprobs - logprobs
    return torch.exp(ref_diff) - ref_diff - 1.0
