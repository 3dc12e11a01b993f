"""Segment attention over packed rows and the decode step's attention, against plain masked
attention written out from the definition."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from tandem.models.attention import SegmentLayout, decode_attention, segment_attention
from tandem.models.forward import pack_rows, packed_logprobs

# rows of width 16: (prefix length, [(start, length, sees prefix), ...])
ROWS = [
    (5, [(5, 4, True), (9, 1, True), (10, 6, True)]),  # a prompt and three completions
    (3, [(3, 2, True), (5, 7, False)]),  # the second stretch sees only itself (SFT-style packing)
    (7, []),  # a prompt alone
    (2, [(2, 3, True)]),  # short, padded to the width
]
WIDTH = 16


def _layout() -> SegmentLayout:
    segments = [(r, start, length, sees) for r, (_, segs) in enumerate(ROWS) for start, length, sees in segs]
    return SegmentLayout.build(WIDTH, [p for p, _ in ROWS], segments)


def _dense_mask() -> tuple[torch.Tensor, torch.Tensor]:
    """[R, 1, L, L] may-attend from the definition, and [R, L] which positions hold a token."""
    mask = torch.zeros(len(ROWS), 1, WIDTH, WIDTH, dtype=torch.bool)
    used = torch.zeros(len(ROWS), WIDTH, dtype=torch.bool)
    for r, (prefix, segs) in enumerate(ROWS):
        used[r, :prefix] = True
        for i in range(prefix):
            mask[r, 0, i, : i + 1] = True
        for start, length, sees in segs:
            used[r, start : start + length] = True
            for i in range(start, start + length):
                mask[r, 0, i, start : i + 1] = True
                if sees:
                    mask[r, 0, i, :prefix] = True
    for r in range(len(ROWS)):  # padding sees itself, so the reference has no empty softmax
        for i in range(WIDTH):
            if not used[r, i]:
                mask[r, 0, i, i] = True
    return mask, used


def _masked_attention(q, k, v, mask):
    """Attention as written: softmax(q k^T / sqrt(d) + mask) v, key heads repeated for GQA."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (weights @ v).transpose(1, 2)  # [R, L, H, D]


def test_segment_attention_equals_masked_attention_values_and_gradients():
    g = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (len(ROWS), 4, WIDTH, 8), (len(ROWS), 2, WIDTH, 8)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in (shape_q, shape_kv, shape_kv))
    mask, used = _dense_mask()
    weights = torch.randn(len(ROWS), WIDTH, 4, 8, generator=g, dtype=torch.float64) * used[:, :, None, None]
    grads = []
    for attend in (
        lambda q, k, v: segment_attention(q, k, v, _layout(), None),
        lambda q, k, v: _masked_attention(q, k, v, mask),
    ):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        (out * weights).sum().backward()
        grads.append((out.detach()[used], [t.grad for t in leaves]))
    (out_seg, grads_seg), (out_ref, grads_ref) = grads
    torch.testing.assert_close(out_seg, out_ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads_seg, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_layout_of_packed_rows_matches_their_dense_mask():
    """pack_rows' layout and its 4D mask describe the same pattern: each completion sees the
    prompt and itself."""
    packed = pack_rows([([1, 2, 3], [[4, 5], [6], []]), ([7, 8], [[9, 10, 11]])])
    layout = packed.layout
    assert layout.prefix_width == 3 and layout.rows.tolist() == [0, 0, 1]
    # completion 0 of row 0 at columns 3-4: sees the prompt (0-2) and itself causally; its third
    # position is padding up to the longest completion (3)
    assert layout.mask[0, 0, :2].tolist() == [
        [True] * 3 + [True, False, False],
        [True] * 3 + [True, True, False],
    ]
    assert layout.query_index[0].tolist() == [3, 4, 4]
    # row 1's prompt is 2 long: the third prefix column is hidden from its completion
    assert layout.mask[2, 0, 0].tolist() == [True, True, False, True, False, False]
    assert packed.attention_mask[0, 0, 4].tolist() == [True, True, True, True, True, False]


def test_packed_logprobs_by_segments_equal_the_dense_mask_path(tiny_model_dir):
    """Same log-probs and gradients whichever attention runs (dense mask: `layout=None`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is exercised
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()

    packed = pack_rows([(ids(7), [ids(5), ids(9), [], ids(1)]), (ids(12), [ids(3), ids(4)]), (ids(2), [])])
    results = []
    for rows in (dataclasses.replace(packed, layout=None), packed):
        model.zero_grad()
        logprobs = packed_logprobs(model, rows)
        (logprobs * torch.linspace(0.1, 1.0, logprobs.shape[1])).sum().backward()
        results.append((logprobs.detach(), [p.grad.clone() for p in model.parameters()]))
    assert model.config._attn_implementation == "tandem_sdpa"
    (dense, dense_grads), (segs, seg_grads) = results
    torch.testing.assert_close(segs, dense, rtol=1e-5, atol=1e-6)
    for a, b in zip(seg_grads, dense_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_decode_attention_equals_sdpa_with_padding_and_grouped_heads():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(6, 9, 1, 16, generator=g)
    k, v = torch.randn(6, 3, 20, 16, generator=g), torch.randn(6, 3, 20, 16, generator=g)
    mask = torch.ones(6, 1, 1, 20, dtype=torch.bool)
    mask[1, ..., :7] = False  # left padding of a short prompt
    mask[4, ..., :2] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(decode_attention(q, k, v, mask, None), expected, rtol=1e-5, atol=1e-6)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(decode_attention(q, k, v, None, 0.3), expected, rtol=1e-5, atol=1e-6)
