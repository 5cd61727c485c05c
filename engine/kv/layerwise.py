"""Layer-by-layer assembly: stored KV copied into a run's buffer one layer ahead of the forward (LMCache's
layer-wise mode).

A :class:`~engine.kv.pool.Lease` with a :class:`LayerCopies` defers every copy from host memory. An eager forward's
first layer (``LeaseCache``'s layer ``update``) launches them all, layer-major: on CUDA, on a side stream, with an
event recorded after each layer's copies; each layer's ``update`` then makes the forward's stream wait on that
layer's event only, so layer i+1's copy runs while layer i computes. A CUDA graph's replay cannot wait inside
itself, so before one the copies launch whole (one DMA transfer per stored range, engine/kv/dma.py) and the
replay waits for all (measured: bench/results/gpu-profile-llama-2-7b-random.json). On the CPU there are no streams: the deferred copies run
synchronously at launch, so the buffer (and every logit) is bit-identical to copying at fill time.

Copies from GPU memory run at once on the forward's stream. A read of ``Lease.data`` first :meth:`settle`\\ s.
"""

from __future__ import annotations

import torch

from engine.kv.dma import copy_into

CUDA_ONLY = "off: CUDA only (on the CPU copies are synchronous; the same path, bit-identical)"


class LayerCopies:
    """Deferred host-to-buffer copies of one run: per layer (``layer``) or of every layer at once (None)."""

    def __init__(self, n_layers: int, device: torch.device, held: list | None = None):
        self.device = torch.device(device)
        self.n_layers = n_layers
        self.pending: list[tuple[int | None, torch.Tensor, torch.Tensor]] = []  # (layer or None, dst, src)
        self.events: list | None = None  # per layer, once launched on CUDA
        self.stream = None
        self.launched = False
        self.held = [] if held is None else held  # sources of launched DMA transfers (the buffer's list)

    def defers(self, src: torch.Tensor) -> bool:
        """Whether a copy from ``src`` waits for :meth:`launch` (host memory, before the launch)."""
        return not self.launched and src.device.type == "cpu"

    def add(self, layer: int | None, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (a view of buffer layer ``layer``, or of all layers: None) at launch."""
        self.pending.append((layer, dst, src))

    @property
    def waiting(self) -> bool:
        """Copies are deferred and not launched yet."""
        return not self.launched and bool(self.pending)

    def launch(self, by_layer: bool = True) -> None:
        """Enqueue every deferred copy: ``by_layer``, layer-major with an event after each layer's (a forward
        overlaps them), else each one whole, one transfer per stored range (the fewest calls; the caller waits
        for all). On the CPU they run at once, in order."""
        if self.launched:
            return
        self.launched = True
        if not self.pending:
            return
        if self.device.type != "cuda":
            for _, dst, src in self.pending:
                dst.copy_(src)
            self.pending = []
            return
        current = torch.cuda.current_stream(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(current)  # the buffer's earlier users (the last run) come first
        with torch.cuda.stream(self.stream):
            if by_layer:
                self.events = [self._layer(i) for i in range(self.n_layers)]
            else:
                for _, dst, src in self.pending:
                    copy_into(dst, src, self.held)
                self.events = [self._event()] * self.n_layers
        self.pending[0][1].record_stream(self.stream)  # the buffer is the forward stream's; the side stream writes it
        self.pending = []

    def _layer(self, i: int):
        for layer, dst, src in self.pending:
            if layer is None:
                copy_into(dst[i], src[i], self.held)
            elif layer == i:
                copy_into(dst, src, self.held)
        return self._event()

    def _event(self):
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, layer: int) -> None:
        """Launch layer by layer if needed; make the current stream wait for layer ``layer``'s copies."""
        self.launch()
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[layer])

    def settle(self) -> None:
        """Launch whole if needed; make the current stream wait for every copy."""
        self.launch(by_layer=False)
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[-1])  # one stream: the last is after all

    def __repr__(self) -> str:
        return (f"LayerCopies(layers={self.n_layers}, deferred={len(self.pending)}, launched={self.launched}, "
                f"on {self.device})")


def default_on(device) -> bool:
    """Layer-wise copies by default: where the buffer is on CUDA."""
    return torch.device(device).type == "cuda"
