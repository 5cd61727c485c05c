"""engine/kv/dma.py's row description: which views one 2-D DMA transfer copies (the copy itself needs CUDA:
tests/gpu/test_cuda_paths.py)."""

from __future__ import annotations

import torch

from engine.kv.dma import _rows, copy_rows


def _buffer(layers=3, heads=4, capacity=32, dim=8):
    return torch.zeros(layers, 2, 1, heads, capacity, dim)  # a run buffer's layout (engine/kv/buffer.py)


def test_a_layer_slot_range_of_the_run_buffer_is_rows_at_the_capacity_pitch():
    raw = _buffer()
    assert _rows(raw[1, :, 0, :, 5:12]) == (32 * 8, 2 * 4, 7 * 8)
    assert _rows(raw[:, :, 0, :, 5:12]) == (32 * 8, 3 * 2 * 4, 7 * 8)  # every layer: the pitch runs on


def test_a_stored_entry_and_a_token_range_of_it_are_rows_at_their_length_pitch():
    kv = torch.zeros(3, 2, 4, 20, 8)  # [layers, 2, kv_heads, seq, head_dim]
    assert _rows(kv[1]) == (20 * 8, 8, 20 * 8)
    assert _rows(kv[:, :, :, 3:9]) == (20 * 8, 24, 6 * 8)


def test_views_that_are_not_rows_at_one_pitch_are_refused():
    raw = _buffer()
    assert _rows(raw[1, :, 0, ::2, 5:12]) is not None  # every other head: still one pitch (twice as long)
    assert _rows(raw[1, :, 0, :, 5:12, ::2]) is None  # strided inside a row
    assert _rows(raw[1, :, 0, :, 5:12].transpose(0, 1)) is None  # heads before keys/values: two pitches
    assert _rows(torch.zeros(8)) is None


def test_without_cuda_the_caller_copies():
    raw = _buffer()
    src = torch.randn(2, 4, 7, 8)
    assert copy_rows(raw[1, :, 0, :, 5:12], src) is False
