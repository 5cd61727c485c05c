"""Layer-by-layer assembly: stored KV copied into a run's buffer one layer ahead of the forward (LMCache's
layer-wise mode).

A :class:`KVBuffer` with a :class:`LayerCopies` defers every copy from host memory. The first layer the
forward reaches (``BufferedCache``'s layer ``update``) launches them all, layer-major: on CUDA, on a side
stream, with an event recorded after each layer's copies; each layer's ``update`` then makes the forward's
stream wait on that layer's event only, so layer i+1's copy runs while layer i computes. On the CPU there are
no streams: the same deferred copies run synchronously at the first layer, in the same order, so the buffer
(and every logit) is bit-identical to copying at fill time.

Copies from GPU memory are not deferred (device-to-device, a small share of a forward): they run at once on
the forward's stream. Anything that reads the buffer's data directly (``KVBuffer.data``) first
:meth:`settle`\\ s: the forward's stream waits for every copy.
"""

from __future__ import annotations

import torch

CUDA_ONLY = "off: CUDA only (on the CPU copies are synchronous; the same path, bit-identical)"


class LayerCopies:
    """Deferred host-to-buffer copies of one run, per layer."""

    def __init__(self, n_layers: int, device: torch.device):
        self.device = torch.device(device)
        self.pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n_layers)]
        self.events: list | None = None  # per layer, once launched on CUDA
        self.stream = None
        self.launched = False

    def defers(self, src: torch.Tensor) -> bool:
        """Whether a copy from ``src`` waits for :meth:`launch` (host memory, before the launch)."""
        return not self.launched and src.device.type == "cpu"

    def add(self, layer: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` into ``dst`` (a view of the buffer's layer ``layer``) at launch."""
        self.pending[layer].append((dst, src))

    @property
    def waiting(self) -> bool:
        """Copies are deferred and not launched yet."""
        return not self.launched and any(self.pending)

    def launch(self) -> None:
        """Enqueue every deferred copy, layer by layer (at once, in order, on the CPU)."""
        if self.launched:
            return
        self.launched = True
        if not any(self.pending):
            return
        if self.device.type != "cuda":
            for layer in self.pending:
                for dst, src in layer:
                    dst.copy_(src)
            self.pending = [[] for _ in self.pending]
            return
        current = torch.cuda.current_stream(self.device)
        self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(current)  # the buffer's earlier users (the last run) come first
        self.events = []
        with torch.cuda.stream(self.stream):
            for layer in self.pending:
                for dst, src in layer:
                    dst.copy_(src, non_blocking=True)
                    dst.record_stream(self.stream)  # the buffer is the forward stream's; the side stream writes it
                event = torch.cuda.Event()
                event.record(self.stream)
                self.events.append(event)
        self.pending = [[] for _ in self.pending]

    def wait(self, layer: int) -> None:
        """Launch if needed; make the current stream wait for layer ``layer``'s copies."""
        self.launch()
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[layer])

    def settle(self) -> None:
        """Launch if needed; make the current stream wait for every copy."""
        self.launch()
        if self.events:
            torch.cuda.current_stream(self.device).wait_event(self.events[-1])  # one stream: the last is after all

    def __repr__(self) -> str:
        n = sum(len(p) for p in self.pending)
        return f"LayerCopies(layers={len(self.pending)}, deferred={n}, launched={self.launched}, on {self.device})"


def default_on(device) -> bool:
    """Layer-wise copies by default: where the buffer is on CUDA."""
    return torch.device(device).type == "cuda"
