"""Teacher-forced log-probs of completion tokens, with each prompt computed once per group.

A row packs one prompt followed by several of its completions: [prompt | c1 | c2 | ...]. A 4D
attention mask lets every completion see the prompt and itself (causally) but not its siblings,
and position ids restart after the prompt for each completion, so each completion is scored
exactly as if it were alone behind the prompt, while the prompt's tokens are computed (and
back-propagated) once instead of G times. With 180-token prompts and 90-token completions this
halves the tokens of a GRPO step.

How the pattern reaches the model depends on its attention implementation (`attention_route`):
SDPA takes the segment layout (models/attention.py), eager the 4D mask as the additive float mask
it expects (it adds the mask to the scores), and flash-attention, which takes no mask at all,
gets every sequence (prompt + one completion) alone, laid end to end in one row with position ids
restarting at 0; their hidden states are put back at the packed positions, the prompt's from its
first copy, so the log-probs (and gradients) are those of the packed forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.algorithms.logprobs import linear_token_logprobs
from tandem.models.attention import SegmentLayout, use_tandem_attention

_PAD_SEGMENT = 1 << 30
ROUTES = ("segments", "dense", "unpacked")


@dataclass
class SequenceLayout:
    """The packed rows' sequences, each alone, laid end to end in one row of T tokens: what an
    attention that takes sequence boundaries but no mask (flash-attention's varlen) computes."""

    gather_index: torch.Tensor  # [T] flat packed position (row * L + column) of each token
    scatter_index: torch.Tensor  # [R * L] the token whose state each packed position takes (pads: 0)
    position_ids: torch.Tensor  # [1, T] restarting at 0 with each sequence
    cu_seq_lens: torch.Tensor  # [num_sequences + 1] int32, where each sequence starts, then T
    max_length: int  # the longest sequence

    @classmethod
    def build(cls, num_rows: int, width: int, sequences: list[list[tuple[int, int, int]]]) -> SequenceLayout:
        """sequences: each a list of (row, start, length) stretches of the packed rows, in order. A
        position in several sequences (a shared prompt) takes its state from the first."""
        stretches = [
            (k, row * width + start, n) for k, parts in enumerate(sequences) for row, start, n in parts
        ]
        seq_of, firsts, sizes = (torch.tensor(column, dtype=torch.long) for column in zip(*stretches))
        lengths = torch.zeros(len(sequences), dtype=torch.long).index_add_(0, seq_of, sizes)
        assert bool((lengths >= 1).all()), "every sequence holds at least one token"
        num_tokens = int(lengths.sum())
        offsets = torch.arange(num_tokens)
        # token i of the run is token i - (its stretch's first token in the run) of that stretch
        gather_index = torch.repeat_interleave(firsts - (torch.cumsum(sizes, 0) - sizes), sizes) + offsets
        position_ids = offsets - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        scatter_index = torch.full((num_rows * width,), num_tokens, dtype=torch.long)
        scatter_index.scatter_reduce_(0, gather_index, offsets, "amin")  # the first copy
        return cls(
            gather_index=gather_index,
            scatter_index=scatter_index.masked_fill_(scatter_index == num_tokens, 0),
            position_ids=position_ids[None],
            cu_seq_lens=torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)]).int(),
            max_length=int(lengths.max()),
        )

    def to(self, device: torch.device) -> SequenceLayout:
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.__dict__.items()}
        return SequenceLayout(**moved)


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L]
    attention_mask: torch.Tensor  # [R, 1, L, L] bool, True = may attend
    predict_rows: torch.Tensor  # [N] row of the hidden state that predicts each completion token
    predict_cols: torch.Tensor  # [N] its column
    targets: torch.Tensor  # [N] the completion token ids
    completion_lengths: list[int]  # per completion, in row order
    layout: SegmentLayout | None = None  # the same attention pattern, for models/attention.py
    sequences: SequenceLayout | None = None  # the same sequences unpacked, for flash-attention

    def to(self, device: torch.device) -> PackedRows:
        moved = {
            k: v.to(device) if torch.is_tensor(v) or isinstance(v, (SegmentLayout, SequenceLayout)) else v
            for k, v in self.__dict__.items()
        }
        return PackedRows(**moved)


def attention_route(model, packed: PackedRows) -> str:
    """How packed rows reach `model`: "segments" (SDPA, switched to models/attention.py), "dense"
    (the 4D mask: SDPA without a layout, eager), or "unpacked" (anything else: flash-attention)."""
    if use_tandem_attention(model):
        return "segments" if packed.layout is not None else "dense"
    return "dense" if model.config._attn_implementation == "eager" else "unpacked"


def decoder_hidden_states(model, packed: PackedRows, *, route: str | None = None) -> torch.Tensor:
    """The decoder's last hidden states [R, L, H] of packed rows (padding positions: arbitrary).
    `route` (one of ROUTES) overrides `attention_route`: each gives the same states up to rounding."""
    takes_layout = use_tandem_attention(model)  # first: generation and scoring then run alike
    implementation = model.config._attn_implementation or ""
    route = route or attention_route(model, packed)
    if route not in ROUTES:
        raise ValueError(f"route {route!r}: expected one of {', '.join(ROUTES)}")
    decoder = model.get_decoder()
    if route == "unpacked":
        return _unpacked_hidden_states(decoder, packed, flash="flash" in implementation)
    extra, mask = {}, packed.attention_mask
    if route == "segments":
        if not takes_layout or packed.layout is None:
            raise ValueError(f"the segment route needs SDPA and a layout; the model runs {implementation}")
        extra["segment_layout"] = packed.layout
    elif implementation == "eager":
        # eager attention adds the mask to the scores: 0 where visible, the dtype's minimum elsewhere
        dtype = decoder.get_input_embeddings().weight.dtype
        mask = torch.where(mask, torch.zeros((), dtype=dtype, device=mask.device), torch.finfo(dtype).min)
    elif not takes_layout:
        raise ValueError(f"{implementation} takes no 4D attention mask: use the unpacked route")
    return decoder(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=mask,
        use_cache=False,
        **extra,
    ).last_hidden_state


def _unpacked_hidden_states(decoder, packed: PackedRows, *, flash: bool) -> torch.Tensor:
    """The decoder over `packed.sequences` (one row, no mask), scattered back to [R, L, H]. Sequence
    boundaries reach flash-attention as cu_seq_lens (its varlen kernel, no per-layer device sync),
    any other attention as the restarting position ids (transformers' packed-sequence mask)."""
    sequences = packed.sequences
    if sequences is None:
        raise ValueError("these packed rows carry no sequence layout: build them with pack_rows")
    extra = {}
    if flash:
        extra = {
            "cu_seq_lens_q": sequences.cu_seq_lens,
            "cu_seq_lens_k": sequences.cu_seq_lens,
            "max_length_q": sequences.max_length,
            "max_length_k": sequences.max_length,
        }
    input_ids = packed.input_ids.reshape(-1).index_select(0, sequences.gather_index)[None]  # [1, T]
    hidden = decoder(
        input_ids=input_ids,
        position_ids=sequences.position_ids,
        attention_mask=None,
        use_cache=False,
        **extra,
    ).last_hidden_state  # [1, T, H]
    num_rows, width = packed.input_ids.shape
    return hidden[0].index_select(0, sequences.scatter_index).view(num_rows, width, -1)


def pack_rows(rows: list[tuple[list[int], list[list[int]]]], pad_id: int = 0) -> PackedRows:
    """rows: (prompt ids, [completion ids, ...]) -> the packed batch; completions keep row order."""
    widths = [len(p) + sum(len(c) for c in cs) for p, cs in rows]
    num_rows, width = len(rows), max(widths)
    input_ids = torch.full((num_rows, width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((num_rows, width), dtype=torch.long)
    segment = torch.full((num_rows, width), _PAD_SEGMENT, dtype=torch.long)
    pred_rows, pred_cols, targets, lengths = [], [], [], []
    segments = []  # (row, start, length, sees the prompt)
    sequences = []  # each completion behind its prompt; a prompt alone if it has none
    for r, (prompt, completions) in enumerate(rows):
        n = len(prompt)
        input_ids[r, :n] = torch.tensor(prompt, dtype=torch.long)
        position_ids[r, :n] = torch.arange(n)
        segment[r, :n] = 0
        start = n
        for k, completion in enumerate(completions):
            m = len(completion)
            lengths.append(m)
            if m == 0:
                continue
            input_ids[r, start : start + m] = torch.tensor(completion, dtype=torch.long)
            position_ids[r, start : start + m] = torch.arange(n, n + m)
            segment[r, start : start + m] = k + 1
            segments.append((r, start, m, True))
            sequences.append([(r, 0, n), (r, start, m)])
            # token 0 is predicted by the prompt's last position, token t by the completion's t-1
            cols = [n - 1] + list(range(start, start + m - 1))
            pred_rows += [r] * m
            pred_cols += cols
            targets += completion
            start += m
        if start == n and n:  # no completion to carry the prompt
            sequences.append([(r, 0, n)])
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # [L(query), L(key)]
    visible = (segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None])  # [R, Lq, Lk]
    return PackedRows(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=(causal[None] & visible)[:, None],
        predict_rows=torch.tensor(pred_rows, dtype=torch.long),
        predict_cols=torch.tensor(pred_cols, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        completion_lengths=lengths,
        layout=SegmentLayout.build(width, [len(p) for p, _ in rows], segments),
        sequences=SequenceLayout.build(num_rows, width, sequences) if sequences else None,
    )


def packed_logprobs(
    model,
    packed: PackedRows,
    *,
    temperature: float = 1.0,
    head_dtype: torch.dtype | None = torch.float32,
    chunk_size: int = 256,
    route: str | None = None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(token | prompt, earlier tokens of the same completion): [num_completions, T] float32.

    T is the longest completion; entries past a completion's length are 0. `head_dtype` is the
    dtype of the output projection (fp32 by default, whatever the body's precision). `route`: see
    `decoder_hidden_states` (default: the model's own). `return_entropy`: also the entropy of each
    token's (tempered) next-token distribution, [num_completions, T] without gradient, computed in
    the same chunks of `chunk_size` x vocab logits as the log-probs (algorithms/logprobs.py).
    """
    lengths = packed.completion_lengths
    out = torch.zeros(
        len(lengths), max(lengths, default=0), dtype=torch.float32, device=packed.input_ids.device
    )
    if packed.targets.numel() == 0:
        return (out, out.clone()) if return_entropy else out
    hidden = decoder_hidden_states(model, packed, route=route)  # [R, L, H]
    weight = model.get_output_embeddings().weight
    if head_dtype is not None and weight.dtype != head_dtype:
        weight = weight.to(head_dtype)
    token_logprobs = linear_token_logprobs(
        hidden[packed.predict_rows, packed.predict_cols],
        weight,
        packed.targets,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=return_entropy,
    )
    lengths_t = torch.tensor(lengths, device=out.device)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=out.device), lengths_t)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    cols = torch.arange(rows.numel(), device=out.device) - starts[rows]
    if return_entropy:
        token_logprobs, token_entropy = token_logprobs
        return out.index_put((rows, cols), token_logprobs), out.detach().index_put(
            (rows, cols), token_entropy
        )
    return out.index_put((rows, cols), token_logprobs)


class PackedLogprobsModule(torch.nn.Module):
    """A causal LM whose forward is `packed_logprobs`: the module DDP and DeepSpeed wrap, so that
    their forward hooks (DDP's reducer, ZeRO-3's parameter gathering) see every training forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, packed: PackedRows, temperature: float = 1.0, return_entropy: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return packed_logprobs(self.model, packed, temperature=temperature, return_entropy=return_entropy)
