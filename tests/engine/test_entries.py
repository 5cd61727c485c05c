"""What each kind of stored entry says of one layer (``layer_view``, ``kept_at``, ``level``) agrees with what it
writes into a run's lease: a float entry, an int8 one (dequantized) and a compressed one (each layer its own
tokens, the dropped ones zero in the view). The arms read entries only through these, never by their class."""

from __future__ import annotations

import torch

from engine.kv import Lease, LayeredKV, ModuleKV, QuantKV

LAYERS, HEADS, TOKENS, DIM = 3, 2, 12, 8


def _entry() -> ModuleKV:
    kv = torch.randn(LAYERS, 2, HEADS, TOKENS, DIM, generator=torch.Generator().manual_seed(0))
    return ModuleKV(kv, torch.arange(TOKENS), torch.arange(100, 100 + TOKENS))


def _layered(full: ModuleKV) -> LayeredKV:
    kept = [torch.arange(TOKENS), torch.tensor([0, 2, 3, 7, 11]), torch.tensor([1, 5])]
    return LayeredKV([full.kv[i][:, :, k] for i, k in enumerate(kept)], kept, full.positions, full.token_ids)


def _written(entry, a: int, b: int) -> list[torch.Tensor]:
    """Per layer, what ``entry.write_into`` puts in a fresh lease: [2, heads, n_layer, dim]."""
    lease = Lease.private(torch.zeros(LAYERS, 2, 1, HEADS, TOKENS, DIM))
    entry.write_into(lease, a, b)
    return [lease.data[i, :, 0, :, :n].float() for i, n in enumerate(lease.lengths)]


def test_every_entry_kind_views_a_layer_as_it_writes_it():
    full = _entry()
    for entry in (full, QuantKV.quantize(full, "int8"), _layered(full)):
        for a, b in ((0, TOKENS), (2, 9), (5, 6)):
            written = _written(entry, a, b)
            for layer in range(LAYERS):
                view, kept = entry.layer_view(layer, a, b), entry.kept_at(layer, a, b)
                assert view.shape == (2, HEADS, b - a, DIM) and view.dtype == torch.float32
                assert torch.equal(view[:, :, kept], written[layer]), (type(entry).__name__, a, b, layer)
                dropped = torch.ones(b - a, dtype=torch.bool)
                dropped[kept] = False
                assert not view[:, :, dropped].any()  # a token the layer dropped is zeros
            assert entry.level == (len({len(w[0, 0]) for w in written}) == 1 and len(written[0][0, 0]) == b - a)


def test_a_compressed_entry_keeps_per_layer_what_it_was_given():
    layered = _layered(_entry())
    assert layered.kept_at(1, 2, 9).tolist() == [0, 1, 5]  # tokens 2, 3 and 7, from 2
    assert layered.kept_at(2, 0, TOKENS).tolist() == [1, 5] and not layered.level
    assert _entry().kept_at(1, 2, 9).tolist() == list(range(7)) and _entry().level
