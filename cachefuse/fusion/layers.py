"""The loaded layers the fusor reads: every loaded chunk's K/V as full-length views, one layer at a time.

Imports torch, cachefuse.ops, cachefuse.loading.loader (the serial and pipelined per-layer reads) and
cachefuse.fusion.plan; never vllm. Whole entries (`FuseRequest.loaded`) are sliced on first use in the
pass's thread; fetched chunks (`FuseRequest.fetched`) are gathered and re-rotated to their target
positions on the loader's thread, so layer i+1 is read and rotated while layer i computes
(docs/loading.md). Loading owns the I/O; this module owns what the pass sees of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cachefuse import ops
from cachefuse.fusion.plan import FuseRequest
from cachefuse.loading.loader import LayerKV, LayerUnavailable, PipelinedLoader, SerialLoader


@dataclass
class _Layer:
    """One layer of every loaded segment, rows in segment order ([num_loaded, num_kv_heads, head_dim])."""

    k_nope: torch.Tensor
    v: torch.Tensor
    k: torch.Tensor | None
    """k_nope rotated at its target positions; None until a layer that merges needs it."""
    ready: torch.cuda.Event | None = None
    """On a GPU: recorded on the loader's copy stream after the layer's copies and rotation; the pass's
    stream waits on it before the first read (None: on the CPU, nothing to wait for)."""


class LoadedLayers:
    """Full-length views of the loaded chunks, one layer at a time: `advance(layer)` for layers 0, 1, ...

    Whole entries (`request.loaded`) are sliced on first use in the pass's thread. Fetched chunks
    (`request.fetched`) come through a PipelinedLoader (preload_depth >= 1) whose worker thread also
    gathers and re-rotates, so layer i+1 is read and rotated while layer i computes, or a SerialLoader.
    Use it as a context manager: leaving the block joins the loader thread, also on an exception.
    """

    def __init__(self, request: FuseRequest, num_tokens: int, shape, rope_spec,
                 first_merged_layer: int, check_layers: set[int] | frozenset[int] = frozenset(),
                 device: torch.device | str = "cpu") -> None:
        self.num_tokens, self.shape, self.rope_spec = num_tokens, shape, rope_spec
        self.device = torch.device(device)
        # On a GPU, host-to-device copies and re-rotation run on a side stream (the loader thread's),
        # so layer i+1 travels while layer i computes on the pass's stream.
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The pass's stream, read once: the pass runs on the stream current where it starts, and asking
        # torch.cuda.current_stream every layer costs host time on a launch-bound pass
        self.pass_stream = torch.cuda.current_stream(self.device) if self.copy_stream is not None else None
        self.first_merged_layer = first_merged_layer  # layers before it compute every row: no rotation
        # A full layer that is no check layer never reads loaded K/V (CacheBlend's layer 0): not fetched.
        self.unread_layers = set(range(first_merged_layer)) - set(check_layers)
        indices = sorted({*request.loaded, *request.fetched})
        self.sources = [(request.segments[i], request.loaded.get(i), request.fetched.get(i)) for i in indices]
        # Rows of every loaded segment, in segment order: one rotation and one scatter per layer.
        self.loaded_rows = (torch.cat([torch.arange(s.start, s.end, device=self.device) for s, _, _ in self.sources])
                            if self.sources else torch.zeros(0, dtype=torch.int64, device=self.device))
        # When the loaded segments are one run of positions (no hole between them, the common case), their
        # rows are a slice: a copy into it is cheaper than a scatter, on the GPU and in host time.
        spans = [(s.start, s.end) for s, _, _ in self.sources]
        contiguous = bool(spans) and all(end == start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        self.loaded_slice = slice(spans[0][0], spans[-1][1]) if contiguous else None
        self.fetch = request.fetch_layer if request.fetched else None
        self.loader: SerialLoader | PipelinedLoader | None = None
        if self.fetch is not None:
            depth = request.preload_depth
            self.loader = (PipelinedLoader(self._work, shape.num_layers, depth) if depth >= 1
                           else SerialLoader(self._work, shape.num_layers))
        self._layer, self._current = -1, None

    def __enter__(self) -> LoadedLayers:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.loader is not None:
            self.loader.close()

    def advance(self, layer: int) -> None:
        """Make `layer` current (layers in order); re-raises loader.LayerUnavailable at its layer."""
        self._layer = layer
        self._current = self.loader.layer(layer) if self.loader is not None else None

    @torch.inference_mode()
    def _work(self, layer: int) -> _Layer:
        """Gather (and from the first merged layer on, re-rotate) one layer; the loader thread's work."""
        if not self.sources or layer in self.unread_layers:
            empty = torch.zeros((0, self.shape.num_kv_heads, self.shape.head_dim), dtype=self.shape.dtype,
                                device=self.device)
            return _Layer(empty, empty, empty)
        if self.copy_stream is None:
            return self._gather(layer)
        with torch.cuda.device(self.device), torch.cuda.stream(self.copy_stream):
            data = self._gather(layer)
            data.ready = self.copy_stream.record_event()
        return data

    def _gather(self, layer: int) -> _Layer:
        fetched: LayerKV = self.fetch(layer) if self.fetch is not None else {}
        parts = []
        for seg, entry, key in self.sources:
            k_nope, v = (entry.k_nope[layer], entry.v[layer]) if entry is not None else fetched[key]
            if k_nope.shape[0] != seg.length or v.shape[0] != seg.length:
                raise LayerUnavailable(key, layer, "length_mismatch")
            parts.append((k_nope, v))
        k_nope = self._stage([k for k, _ in parts])  # [num_loaded, num_kv_heads, head_dim] on the device
        v = self._stage([v for _, v in parts])
        # On a CPU the loader thread rotates ahead (overlapping the pass); on a GPU `rotated()` gathers
        # and rotates in one kernel straight into the merged K (no rotated copy to write and re-read).
        rotate_here = layer >= self.first_merged_layer and self.device.type != "cuda"
        k = self._rotate(k_nope) if rotate_here else None
        return _Layer(k_nope, v, k)

    def _stage(self, parts: list[Tensor]) -> Tensor:
        """The parts concatenated on the model's device. Host parts are copied straight into their slice of
        one device buffer: from page-locked memory (the host tier's `pin_memory`) each copy is an
        asynchronous DMA on the copy stream, with no host-side concatenation (a host memcpy of every
        loaded byte, measured slower than PCIe itself); entries of the device tier are concatenated
        where they are."""
        if self.device.type != "cuda" or all(t.device == self.device for t in parts):
            return torch.cat(parts).to(self.device)
        out = torch.empty((sum(t.shape[0] for t in parts), *parts[0].shape[1:]), dtype=parts[0].dtype,
                          device=self.device)
        offset = 0
        for part in parts:
            out[offset:offset + part.shape[0]].copy_(part, non_blocking=True)
            offset += part.shape[0]
        return out

    def _rotate(self, k_nope: torch.Tensor) -> torch.Tensor:
        return ops.apply_rope(k_nope, self.loaded_rows, self.rope_spec)

    def _data(self, layer: int) -> _Layer:
        if layer != self._layer:
            raise RuntimeError(f"layer {layer} asked for while layer {self._layer} is current")
        if self._current is None:
            self._current = self._work(layer)  # whole entries: gathered here, on first use
        if self._current.ready is not None:  # the copy stream's work for this layer, before any read
            stream = self.pass_stream
            stream.wait_event(self._current.ready)
            for tensor in (self._current.k_nope, self._current.v, self._current.k):
                if tensor is not None:  # allocated on the copy stream, read on this one
                    tensor.record_stream(stream)
            self._current.ready = None
        return self._current

    def stripped(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, num_kv_heads, head_dim] K (RoPE stripped) and V, zeros where nothing is loaded."""
        data = self._data(layer)
        shape = (self.num_tokens, self.shape.num_kv_heads, self.shape.head_dim)
        k_nope = torch.zeros(shape, dtype=self.shape.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.shape.dtype, device=self.device)
        self._scatter(k_nope, data.k_nope)
        self._scatter(v, data.v)
        return k_nope, v

    def rotated(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Loaded K re-rotated at its target positions, and V; both new tensors.

        Rows outside loaded segments are left uninitialised: they are forced rows, which the
        caller overwrites with freshly computed K/V before anything reads them.
        """
        data = self._data(layer)
        shape = (self.num_tokens, self.shape.num_kv_heads, self.shape.head_dim)
        k = torch.empty(shape, dtype=self.shape.dtype, device=self.device)
        v = torch.empty(shape, dtype=self.shape.dtype, device=self.device)
        if data.k is not None:  # rotated on the loader thread
            self._scatter(k, data.k)
        else:  # gathered and rotated in one pass, no rotated copy in between
            ops.gather_rotate(data.k_nope, k, self.loaded_rows, self.loaded_rows, self.rope_spec)
        self._scatter(v, data.v)
        return k, v

    def _scatter(self, full: torch.Tensor, loaded: torch.Tensor) -> None:
        """Writes the loaded segments' rows (`loaded`, in segment order) into the full-length `full`."""
        if self.loaded_slice is not None:
            full[self.loaded_slice].copy_(loaded)
        else:
            full[self.loaded_rows] = loaded
