"""Batched sampling of G completions per prompt, with the sampling distribution's log-probs.

Each prompt is prefilled once and its KV cache repeated G times (a group shares its prompt);
finished rows leave the batch so the tail of a generation costs only what is still running.
The log-prob of each sampled token is taken from the same logits it was drawn from
(temperature applied, before top-k/top-p truncation, as the loss expects).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tandem.models.attention import use_tandem_attention


class PreallocatedLayer(DynamicLayer):
    """A KV-cache layer that writes into a buffer of fixed capacity instead of concatenating.

    transformers' DynamicLayer does torch.cat on every decode step, which copies the whole
    cache: measured here, 59% of a CPU decode step of the 135M model at batch 32.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            shape = (*key_states.shape[:2], self.capacity, key_states.shape[3])
            self._k, self._v = key_states.new_empty(shape), value_states.new_empty(shape)
        new = key_states.shape[-2]
        if self.length + new > self._k.shape[2]:  # past the planned capacity: grow (rare)
            pad = (0, 0, 0, self.length + new - self._k.shape[2])
            self._k, self._v = F.pad(self._k, pad), F.pad(self._v, pad)
        self._k[:, :, self.length : self.length + new] = key_states
        self._v[:, :, self.length : self.length + new] = value_states
        self.length += new
        self._views()
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.length:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.length:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()


def _kv_cache(model, capacity: int) -> DynamicCache:
    """A DynamicCache whose full-attention layers are preallocated (others are left as they are)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [PreallocatedLayer(capacity) if type(x) is DynamicLayer else x for x in cache.layers]
    return cache


@dataclass
class Generation:
    """Completions ordered prompt by prompt: index p * G + g."""

    token_ids: list[list[int]]  # sampled ids, the eos token included when one was sampled
    logprobs: list[list[float]]  # log p_sampler of each sampled id
    finished: list[bool]  # eos sampled (False: cut at max_new_tokens)


def sample_next(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits [N, V]; returns (ids [N], log p of those ids [N]).

    temperature 0 is greedy decoding (log-probs then at temperature 1). `uniform` [N] (on the
    logits' device) are the draws' uniform points; without it they come from `generator`.
    A row with a non-finite logit gets id 0 here, never one past the vocabulary: `bad_rows` finds
    those rows and generation stops there with an error.
    """
    if temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        ids = logprobs.argmax(dim=-1)
        return ids, logprobs.gather(1, ids[:, None]).squeeze(1)
    logits = logits.float()
    logprobs = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    scores = logprobs
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # drop a token once the mass before it already reaches top_p (the first is always kept)
        drop_sorted = (cumulative - sorted_scores.softmax(dim=-1)) >= top_p
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    ids = draw(scores.exp(), generator, uniform)
    return ids, logprobs.gather(1, ids[:, None]).squeeze(1)


def bad_rows(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool: rows of logits [N, V] holding a NaN or an infinity (fp16 overflow, a broken
    checkpoint). Stays on the device: generation looks at it when it next synchronises anyway."""
    return ~torch.isfinite(logits).all(dim=-1)


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Uniform draws in [0, 1) from a CPU generator, moved to `device`: the random stream is the
    same whichever device samples (a CUDA tensor cannot be drawn with a CPU generator, and a CUDA
    generator would make the stream depend on the GPU), and a checkpoint's CPU generator state
    resumes it bit for bit."""
    u = torch.rand(shape, generator=generator, dtype=torch.float32)
    return u if device.type == "cpu" else u.to(device, non_blocking=True)


def draw(
    weights: torch.Tensor, generator: torch.Generator | None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One index per row of non-negative `weights` [N, V] (not necessarily normalised), drawn with
    probability proportional to its weight, by inverting the cumulative sum at one uniform per row
    (`uniform` [N], else drawn from `generator`).

    torch.multinomial draws V exponentials per row instead: measured here, 28 ms per decode step at
    batch 32 over a 49,152-token vocabulary, a third of a bf16 decode step; this costs about 1 ms.
    A zero weight is never drawn: its cumulative value equals its predecessor's, and the search
    returns the first index whose cumulative value exceeds the uniform point. A row whose weights
    are not finite (NaN logits) would search past the end; it gets index 0 instead."""
    cdf = weights.float().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = uniforms(total.shape, generator, weights.device) if uniform is None else uniform.view(-1, 1)
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # stays below the top
    ids = torch.searchsorted(cdf, point, right=True).squeeze(1)
    return torch.where(ids < weights.shape[-1], ids, 0)


def head_weight(model) -> torch.Tensor:
    """The output projection in float32, as the trainer scores tokens (models/forward.py
    `packed_logprobs`, fp32 head over the body's hidden states): the sampler's log-probs of a
    bf16 rollout copy then differ from the trainer's only by the body's precision. Made once per
    generation call (the weights change between calls)."""
    weight = model.get_output_embeddings().weight
    return weight if weight.dtype == torch.float32 else weight.float()


def sync_every(device: torch.device) -> int:
    """Decode steps between host synchronisations (finished rows leave the batch, a non-finite
    logit is reported). On the CPU there is nothing to wait for, so every step, which keeps the
    batch as small as possible; on a GPU, reading a flag back every step would stall the kernel
    queue, so finished rows ride along (their extra tokens are dropped) for up to 8 steps."""
    return 1 if device.type == "cpu" else 8


@torch.inference_mode()
def generate_groups(
    model,
    prompts: list[list[int]],
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    batch_size: int = 32,
    generator: torch.Generator | None = None,
    check_every: int | None = None,
) -> Generation:
    """G sampled completions for each prompt (token ids), batch_size sequences per forward.

    Each (decode step, completion) has its own uniform draw, taken from `generator` on the CPU a
    batch at a time, so the completions do not depend on the device, on `check_every` (decode
    steps between host synchronisations; default `sync_every(device)`) or on when other rows
    finished. A non-finite logit is a RuntimeError naming the step, never an invalid token."""
    use_tandem_attention(model)  # the decode step's attention (models/attention.py), whatever ran before
    prompts_per_batch = max(1, batch_size // num_generations)
    head = head_weight(model)
    result = Generation([], [], [])
    for start in range(0, len(prompts), prompts_per_batch):
        chunk = prompts[start : start + prompts_per_batch]
        part = _generate_chunk(
            model,
            head,
            chunk,
            num_generations,
            max_new_tokens,
            eos_token_ids,
            pad_token_id,
            _Sampling(temperature, top_k, top_p, generator),
            check_every or sync_every(head.device),
        )
        result.token_ids += part.token_ids
        result.logprobs += part.logprobs
        result.finished += part.finished
    return result


@dataclass
class _Sampling:
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def _next_logits(model, head: torch.Tensor, **inputs) -> torch.Tensor:
    """The last position's logits [B, V] in float32: the decoder, then the fp32 head."""
    hidden = model.get_decoder()(use_cache=True, **inputs).last_hidden_state[:, -1]
    return F.linear(hidden.to(head.dtype), head)


def _generate_chunk(
    model, head, prompts, num_generations, max_new_tokens, eos_token_ids, pad_token_id, sampling, check_every
) -> Generation:
    device = head.device
    num_rows = len(prompts) * num_generations
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the same column
        input_ids[i, width - len(p) :] = torch.tensor(p)
        attention_mask[i, width - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    # every (step, completion)'s uniform point, drawn up front: one transfer, not one per token
    draws = None
    if sampling.temperature != 0:
        draws = uniforms((max_new_tokens, num_rows), sampling.generator, device)

    cache = _kv_cache(model, width + max_new_tokens)
    logits = _next_logits(
        model,
        head,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
    )
    cache.batch_repeat_interleave(num_generations)
    logits = logits.repeat_interleave(num_generations, dim=0)
    attention_mask = attention_mask.repeat_interleave(num_generations, dim=0)
    next_position = position_ids[:, -1:].repeat_interleave(num_generations, dim=0) + 1

    eos = torch.tensor(eos_token_ids, device=device)
    tokens = torch.zeros((num_rows, max_new_tokens), dtype=torch.long, device=device)
    token_logprobs = torch.zeros((num_rows, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.full((num_rows,), max_new_tokens, dtype=torch.long, device=device)
    running = torch.ones(num_rows, dtype=torch.bool, device=device)  # no eos sampled yet
    broken = torch.full((num_rows,), -1, dtype=torch.long, device=device)  # step of a non-finite logit
    active = torch.arange(num_rows, device=device)  # which output row each batch row feeds
    for step in range(max_new_tokens):
        ids, lps = sample_next(
            logits,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            generator=sampling.generator,
            uniform=None if draws is None else draws[step].index_select(0, active),
        )
        live = running.index_select(0, active)  # rows past their eos ride along, recording nothing
        tokens[active, step] = torch.where(live, ids, tokens[active, step])
        token_logprobs[active, step] = torch.where(live, lps, token_logprobs[active, step])
        broken[active] = torch.where(live & bad_rows(logits) & (broken[active] < 0), step, broken[active])
        ended = live & torch.isin(ids, eos)
        lengths[active] = torch.where(ended, step + 1, lengths[active])
        running[active] = live & ~ended
        last = step == max_new_tokens - 1
        if last or (step + 1) % check_every == 0:  # the only host synchronisation
            _raise_if_broken(broken)
            keep = running.index_select(0, active)
            if last or not bool(keep.any()):
                break
            if not bool(keep.all()):
                keep = keep.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                active, ids, attention_mask, next_position = (
                    active[keep],
                    ids[keep],
                    attention_mask[keep],
                    next_position[keep],
                )
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], dim=1)
        logits = _next_logits(
            model,
            head,
            input_ids=ids[:, None],
            attention_mask=attention_mask,
            position_ids=next_position,
            past_key_values=cache,
        )
        next_position = next_position + 1
    _raise_if_broken(broken)
    lengths_list = lengths.tolist()
    ids_rows, lps_rows = tokens.tolist(), token_logprobs.tolist()
    return Generation(
        [row[:n] for row, n in zip(ids_rows, lengths_list)],
        [row[:n] for row, n in zip(lps_rows, lengths_list)],
        (~running).tolist(),
    )


def _raise_if_broken(broken: torch.Tensor) -> None:
    steps = broken[broken >= 0]
    if steps.numel():
        raise RuntimeError(
            f"generation produced a non-finite logit (NaN or infinity) at decode step {int(steps.min())} "
            f"in {steps.numel()} completion(s): the rollout weights overflow their dtype (fp16 does "
            "easily; use sampling.dtype=bfloat16 or float32) or hold NaNs (check the checkpoint / last update)"
        )
