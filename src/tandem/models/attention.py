"""Attention over packed rows without the blocks a dense mask wastes, registered with
transformers as the attention implementation "tandem_sdpa".

A packed GRPO row is [prompt | c1 | c2 | ...] (models/forward.py): each completion sees the
prompt and itself, never a sibling. Given that as a dense [L, L] mask, SDPA computes every
query against every key of the row (a mask also stops it from skipping the causal half and
makes transformers repeat the key/value heads for grouped-query attention): with G = 4 and
completions as long as the prompt P, 25 P^2 scores where 6.5 P^2 are needed (3.8 times).

`SegmentLayout` describes a packed batch instead: each row starts with a prefix (the prompt)
that attends causally to itself, followed by segments (the completions) that attend causally
to themselves and, if marked so, to their row's prefix. `segment_attention` computes that as
two SDPA calls, one over the prefixes with the causal flag and one over the segments gathered
to [segments, longest segment] with their prefix's keys in front, and scatters the results
back to packed positions. The result equals the dense-mask attention up to rounding (the
tests compare both, values and gradients); padding positions get arbitrary values, as they do
under the dense mask, and nothing reads them.

On CUDA the key/value heads are repeated to the query heads before SDPA: its `enable_gqa` runs
only on the flash and math kernels, and the segment call's mask rules out flash, so grouped heads
leave that call (and, in fp32, the prefix call) on the math kernel. Expanded, the mask-free
prefix call can take the flash kernel and the masked segment call the memory-efficient one. On
the CPU the calls keep `enable_gqa`, as tuned there.

The model's forward receives the layout as the keyword `segment_layout`, which transformers
passes down to every attention call. A decode step (one new token per row) goes to
`decode_attention`, two batched matmuls, faster than SDPA's CPU kernel there (benchmarks/MEASUREMENTS.md).
Anything else is transformers' "sdpa" unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_NAME = "tandem_sdpa"


@dataclass
class SegmentLayout:
    """Rows of width L: row r's prefix is columns [0, prefix_lengths[r]); segment s lies at
    columns [start, start + length) of row `rows[s]`, and sees its row's prefix if `sees_prefix`."""

    prefix_width: int  # P: the longest prefix
    rows: torch.Tensor  # [S] the row of each segment
    query_index: torch.Tensor  # [S, C] flat index row * L + column of each segment position
    mask: torch.Tensor  # [S, 1, C, P + C] bool: segment position -> (prefix keys | own keys)
    output_index: torch.Tensor  # [R * L] where each packed position's output lies in (prefix | segments)

    @classmethod
    def build(
        cls, width: int, prefix_lengths: list[int], segments: list[tuple[int, int, int, bool]]
    ) -> SegmentLayout:
        """segments: (row, start, length, sees_prefix), each of length >= 1, after its row's prefix."""
        num_rows = len(prefix_lengths)
        prefix_width = max(prefix_lengths, default=0)
        longest = max((length for _, _, length, _ in segments), default=0)
        num_segments = len(segments)
        offsets = torch.arange(longest)
        query_index = torch.zeros((num_segments, longest), dtype=torch.long)
        mask = torch.zeros((num_segments, 1, longest, prefix_width + longest), dtype=torch.bool)
        output_index = torch.zeros(num_rows * width, dtype=torch.long)  # padding reads slot 0
        for r, n in enumerate(prefix_lengths):
            output_index[r * width : r * width + n] = torch.arange(n) + r * prefix_width
        causal = offsets[None, :] <= offsets[:, None]  # [C, C]
        first_segment_slot = num_rows * prefix_width
        for s, (row, start, length, sees_prefix) in enumerate(segments):
            assert length >= 1 and start >= prefix_lengths[row] and start + length <= width
            # positions past the segment's end repeat its last one: their outputs are never read
            query_index[s] = row * width + start + offsets.clamp(max=length - 1)
            if sees_prefix:
                mask[s, 0, :, : prefix_lengths[row]] = True
            mask[s, 0, :, prefix_width:] = causal
            output_index[row * width + start : row * width + start + length] = (
                first_segment_slot + s * longest + torch.arange(length)
            )
        return cls(
            prefix_width=prefix_width,
            rows=torch.tensor([row for row, _, _, _ in segments], dtype=torch.long),
            query_index=query_index,
            mask=mask,
            output_index=output_index,
        )

    def to(self, device: torch.device) -> SegmentLayout:
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in self.__dict__.items()}
        return SegmentLayout(**moved)


def segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: SegmentLayout,
    scale: float | None,
    *,
    expand_heads: bool | None = None,
) -> torch.Tensor:
    """query [R, H, L, D], key/value [R, K, L, D] (K divides H) -> output [R, L, H, D].
    `expand_heads`: repeat the key/value heads instead of SDPA's enable_gqa (default: on CUDA)."""
    num_rows, num_heads, width, head_dim = query.shape
    num_segments, longest = layout.query_index.shape
    prefix = layout.prefix_width
    if expand_heads is None:
        expand_heads = query.is_cuda

    def gather(x: torch.Tensor) -> torch.Tensor:  # [R, h, L, D] -> [S, h, C, D]
        flat = x.transpose(1, 2).reshape(num_rows * width, x.shape[1], head_dim)
        picked = flat.index_select(0, layout.query_index.view(-1))
        return picked.view(num_segments, longest, x.shape[1], head_dim).transpose(1, 2)

    parts = []
    if prefix:
        prefix_out = _sdpa(
            query[:, :, :prefix],
            key[:, :, :prefix],
            value[:, :, :prefix],
            None,
            scale,
            is_causal=True,
            expand_heads=expand_heads,
        )  # [R, H, P, D]
        parts.append(prefix_out.transpose(1, 2).reshape(num_rows * prefix, num_heads, head_dim))
    if num_segments:
        seg_key, seg_value = gather(key), gather(value)
        if prefix:
            seg_key = torch.cat([key[:, :, :prefix].index_select(0, layout.rows), seg_key], dim=2)
            seg_value = torch.cat([value[:, :, :prefix].index_select(0, layout.rows), seg_value], dim=2)
        seg_out = _sdpa(
            gather(query), seg_key, seg_value, layout.mask, scale, is_causal=False, expand_heads=expand_heads
        )  # [S, H, C, D]
        parts.append(seg_out.transpose(1, 2).reshape(num_segments * longest, num_heads, head_dim))
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    return flat.index_select(0, layout.output_index).view(num_rows, width, num_heads, head_dim)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
    *,
    is_causal: bool,
    expand_heads: bool,
) -> torch.Tensor:
    """SDPA with K key/value heads for H query heads: repeated to H (each key head's copies side by
    side, as enable_gqa pairs them) or left to enable_gqa."""
    repeat = query.shape[1] // key.shape[1]
    if expand_heads and repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=repeat > 1 and not expand_heads,
    )


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """One new token per row: query [B, H, 1, D], key/value [B, K, T, D], mask [B, 1, 1, T] bool or
    None -> [B, 1, H, D]. Two batched matmuls with the H / K query heads of a key head side by side."""
    batch, num_heads, _, head_dim = query.shape
    num_kv = key.shape[1]
    q = query.reshape(batch, num_kv, num_heads // num_kv, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)) * (head_dim**-0.5 if scale is None else scale)
    if mask is not None:  # [B, 1, 1, T]; a row with nothing visible cannot occur while decoding
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(weights, value).reshape(batch, 1, num_heads, head_dim)


def tandem_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention-function signature: the segment path when the forward was given a
    `segment_layout` (and nothing it does not model: dropout, soft-capping), SDPA otherwise."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = kwargs.pop("segment_layout", None)
    if layout is not None and dropout == 0.0 and kwargs.get("softcap") is None:
        return segment_attention(query, key, value, layout, scaling), None
    if (
        query.shape[2] == 1
        and dropout == 0.0
        and kwargs.get("softcap") is None
        and (attention_mask is None or attention_mask.dtype == torch.bool)
    ):
        return decode_attention(query, key, value, attention_mask, scaling), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def use_tandem_attention(model: torch.nn.Module) -> bool:
    """Switch a model that runs transformers' SDPA to "tandem_sdpa" (registered on first use).
    Returns whether the model now takes `segment_layout`; other implementations are left alone.
    Generation and the packed forwards both call it, so a model computes the same way whichever
    ran first (a resumed run must sample exactly as the uninterrupted one)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == ATTENTION_NAME:
        return True
    if current != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ATTENTION_NAME not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(ATTENTION_NAME, tandem_sdpa)
        AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = ATTENTION_NAME
    return True
