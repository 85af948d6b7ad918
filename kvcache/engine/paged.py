"""Moving blocks between an engine's paged KV cache and host buffers, device-agnostic.

Engines keep one KV tensor per layer whose block dimension (normally dim 0)
indexes fixed-size pages of ``page_tokens`` tokens. A kvcache *block* groups
``pages_per_block`` consecutive pages of a request, across every layer. Its
payload is the raw bytes of those page tiles, laid out ``[layer][page][tile]``;
the tile is opaque (K/V packing differs between attention backends), so the
same code serves any layout and dtype.

``gather`` copies pages into one payload per block in host memory (pinned when
an accelerator is used) and ``scatter`` copies payloads back into given pages.
Both run on a side stream: gather collects pages into a device staging buffer
(fast device-memory gathers) and moves it to the host in one large copy per
chunk; scatter moves a chunk to the device in one copy and spreads it into the
layers, recording one event per layer so an engine can start computing layer
``i`` as soon as it has arrived. Only ``torch``'s device-generic API is used:
CUDA, Ascend ``npu`` and CPU work alike.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcache.errors import ConfigError
from kvcache.layout import DType, KVLayout

__all__ = ["PagedKVAdapter", "TransferHandle", "kv_dtype"]

log = logging.getLogger(__name__)

_DTYPES = {
    torch.float32: DType.FLOAT32,
    torch.float16: DType.FLOAT16,
    torch.bfloat16: DType.BFLOAT16,
    torch.int8: DType.INT8,
    torch.uint8: DType.INT8,
}
for _name, _dt in (("float8_e4m3fn", DType.FP8_E4M3), ("float8_e5m2", DType.FP8_E5M2)):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _dt


def kv_dtype(dtype: torch.dtype) -> DType:
    """The kvcache dtype name of a torch dtype (part of the key namespace)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unsupported KV cache dtype {dtype}") from None


@dataclass
class TransferHandle:
    """A gather or scatter in flight on the adapter's side stream."""

    host: torch.Tensor
    layer_events: list[Any]
    done: Any
    _module: Any
    #: Recorded once a gather has read every source page (None: already read, or a scatter).
    sources_read: Any = None

    def wait_layer(self, layer: int) -> None:
        """Make the engine's current stream wait (on the device) until ``layer`` has arrived."""
        ev = self.layer_events[layer] if self.layer_events else self.done
        if ev is not None:
            self._module.current_stream().wait_event(ev)

    def release_sources(self) -> None:
        """Make the engine's current stream wait (on the device, never the host) until a
        gather has read its pages, so the engine may overwrite them in its next step while
        the copy to the host is still in flight."""
        if self.sources_read is not None:
            self._module.current_stream().wait_event(self.sources_read)

    def synchronize(self) -> None:
        """Block the calling thread until the whole transfer is complete."""
        if self.done is not None:
            self.done.synchronize()


def _is_row_view(t: torch.Tensor, block_dim: int) -> bool:
    """A (pages, bytes) uint8 view whose rows are contiguous but lie ``stride(0)`` apart:
    a block-outermost group's span in each block of a shared allocation."""
    return (
        block_dim == 0
        and t.dtype == torch.uint8
        and t.dim() == 2
        and t.stride(1) == 1
        and t.stride(0) >= t.shape[1]
    )


class PagedKVAdapter:
    """Gather and scatter kvcache blocks out of / into per-layer paged KV tensors.

    A "layer" may also be a (blocks, span) uint8 view with rows ``stride(0)`` bytes
    apart: one block-outermost group's span per block (``kvcache.engine.block_span``).
    """

    def __init__(
        self,
        caches: Sequence[torch.Tensor],
        *,
        page_tokens: int,
        pages_per_block: int = 1,
        block_dim: int = 0,
        staging_bytes: int = 128 << 20,
    ) -> None:
        if not caches:
            raise ConfigError("no KV cache tensors given")
        first = caches[0]
        if block_dim not in (0, 1) or first.dim() <= block_dim:
            raise ConfigError(
                f"block_dim must be 0 or 1 and within the tensor's dims, got {block_dim}"
            )
        for i, t in enumerate(caches):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ConfigError(
                    f"layer {i} cache is {tuple(t.shape)} {t.dtype} on {t.device}; layer 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}: all must match"
                )
            if not (t.is_contiguous() or _is_row_view(t, block_dim)):
                raise ConfigError(f"layer {i} cache is not contiguous")
        if page_tokens < 1 or pages_per_block < 1:
            raise ConfigError("page_tokens and pages_per_block must be >= 1")
        self.caches = list(caches)
        self.block_dim = block_dim
        self.device = first.device
        self.dtype = first.dtype
        self.page_tokens = page_tokens
        self.pages_per_block = pages_per_block
        self.num_pages = first.shape[block_dim]
        if self.num_pages < 1 or first.numel() == 0:
            raise ConfigError(
                f"the layer caches hold no pages ({tuple(first.shape)}, block_dim {block_dim}): "
                "give caches of at least one non-empty page"
            )
        self.num_layers = len(caches)
        # A page tile: the tensor indexed at one page, with the block dim removed.
        per_page_elems = first.numel() // self.num_pages
        self.tile_bytes = per_page_elems * first.element_size()
        self.payload_bytes = self.num_layers * pages_per_block * self.tile_bytes
        self._flat = [self._as_pages(t) for t in self.caches]
        self._module: Any = torch.get_device_module(self.device)
        self._accelerated = self.device.type != "cpu"
        self._chunk_blocks = max(1, staging_bytes // self.payload_bytes)
        self._work_stream: Any = None
        self._copy_stream: Any = None
        self._buffers: list[torch.Tensor] = []
        self._buffer_free: list[Any] = [None, None]
        # Gathers and scatters may be started from several threads (an engine's forward
        # thread and a background loader); the staging buffers are shared, so starting one
        # is serialised. The transfers themselves still overlap on the device.
        self._start_lock = threading.Lock()

    def _as_pages(self, t: torch.Tensor) -> torch.Tensor:
        """View the layer as bytes: (pages, tile) for block_dim 0, (outer, pages, tile) for 1."""
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
        if _is_row_view(raw, self.block_dim):
            return raw  # a strided (blocks, span) view: rows are pages, kept as they lie
        if self.block_dim == 0:
            return raw.reshape(self.num_pages, -1)
        return raw.reshape(t.shape[0], self.num_pages, -1)

    @property
    def tokens_per_block(self) -> int:
        """Tokens in one kvcache block."""
        return self.page_tokens * self.pages_per_block

    def kv_layout(self) -> KVLayout:
        """The KVLayout of this adapter's blocks (goes into the key namespace)."""
        return KVLayout(
            tokens_per_block=self.tokens_per_block,
            bytes_per_token=self.payload_bytes // self.tokens_per_block,
            dtype=kv_dtype(self.dtype),
            layers_in_block=self.num_layers,
        )

    def pin_host(self, array: Any) -> torch.Tensor:
        """A (blocks, payload_bytes) uint8 tensor over a host array the caller allocated
        (e.g. a kvcache client's shared buffer), page-locked for DMA on CUDA
        (``cudaHostRegister``; released with :meth:`unpin_host`)."""
        if isinstance(array, np.ndarray) and not array.flags.writeable:
            raise ConfigError("the host array is read-only: gathers write into it")
        host = torch.from_numpy(array)
        self._check_host(host, 0)
        if self.device.type == "cuda" and host.numel() and not host.is_pinned():
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            err = cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0)
            if int(err) != 0:
                raise ConfigError(f"cudaHostRegister of {host.numel()} bytes failed: {err}")
        return host

    def unpin_host(self, host: torch.Tensor) -> None:
        """Undo :meth:`pin_host` (before the memory is freed)."""
        if self.device.type == "cuda" and host.numel():
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(host.data_ptr())

    def alloc_host(self, blocks: int) -> torch.Tensor:
        """A (blocks, payload_bytes) uint8 host buffer, pinned when an accelerator is used."""
        return torch.empty(
            (blocks, self.payload_bytes), dtype=torch.uint8, pin_memory=self._accelerated
        )

    def _page_ids(self, page_ids: Any) -> torch.Tensor:
        if not _integer_ids(page_ids):
            raise ConfigError(f"page ids must be integers, got {page_ids!r:.80}")
        ids = torch.as_tensor(page_ids, dtype=torch.long)
        if ids.dim() != 2 or ids.shape[1] != self.pages_per_block:
            raise ConfigError(
                f"page ids must have shape (blocks, {self.pages_per_block}), got {tuple(ids.shape)}"
            )
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_pages):
            raise ConfigError(f"page ids must lie in 0..{self.num_pages - 1}")
        return ids

    def _check_host(self, host: torch.Tensor, blocks: int) -> None:
        if host.dtype != torch.uint8 or host.dim() != 2 or host.shape[1] != self.payload_bytes:
            raise ConfigError(f"host buffer must be uint8 (blocks, {self.payload_bytes})")
        if host.shape[0] < blocks or not host.is_contiguous() or host.device.type != "cpu":
            raise ConfigError(f"host buffer must be a contiguous CPU tensor of >= {blocks} rows")

    def gather(self, page_ids: Any, out: torch.Tensor | None = None) -> TransferHandle:
        """Start copying the pages of each block (rows of ``page_ids``) into host payloads.

        On an accelerator, chunks are double-buffered: while chunk i travels to the
        host on the copy stream, chunk i+1 is gathered on the work stream.
        """
        ids = self._page_ids(page_ids)
        blocks = ids.shape[0]
        host = out if out is not None else self.alloc_host(blocks)
        self._check_host(host, blocks)
        with self._start_lock:
            return self._start_gather(ids, host)

    def _start_gather(self, ids: torch.Tensor, host: torch.Tensor) -> TransferHandle:
        blocks = ids.shape[0]
        step = self._chunk_blocks
        if not self._accelerated:
            for start in range(0, blocks, step):
                stop = min(blocks, start + step)
                self._stage_gather(ids[start:stop], host[start:stop])
            return TransferHandle(host, [], None, self._module)
        work, copy = self._streams()
        dev_ids = ids.to(self.device, non_blocking=True)
        caller = self._module.current_stream(self.device)
        work.wait_stream(caller)
        copy.wait_stream(caller)
        # Made on the caller's stream, read on the work stream: without this the caching
        # allocator hands its memory to the next call's ids while this call still reads
        # them, and pages land in the wrong place (seen with back-to-back scatters).
        dev_ids.record_stream(work)
        gathered = None
        for c, start in enumerate(range(0, blocks, step)):
            stop = min(blocks, start + step)
            buf = self._buffers[c % 2][: stop - start]
            with self._module.stream(work):
                if self._buffer_free[c % 2] is not None:
                    work.wait_event(self._buffer_free[c % 2])
                self._stage_gather(dev_ids[start:stop], buf)
                gathered = self._event(work)
            with self._module.stream(copy):
                copy.wait_event(gathered)
                host[start:stop].copy_(buf, non_blocking=True)
                self._buffer_free[c % 2] = self._event(copy)
        return TransferHandle(host, [], self._event(copy), self._module, sources_read=gathered)

    def _stage_gather(self, ids: torch.Tensor, staging: torch.Tensor) -> None:
        """Gather the pages of ``ids`` (blocks, ppb) into ``staging`` (blocks, payload) rows."""
        n = ids.shape[0]
        ppb = self.pages_per_block
        flat_ids = ids.reshape(-1)
        staged = staging.view(n, self.num_layers, ppb, self.tile_bytes)
        for layer, pages in enumerate(self._flat):
            if self.block_dim == 0:
                staged[:, layer] = pages.index_select(0, flat_ids).view(n, ppb, -1)
            else:
                picked = pages.index_select(1, flat_ids)  # (outer, n*ppb, part)
                staged[:, layer] = (
                    picked.view(pages.shape[0], n, ppb, -1).permute(1, 2, 0, 3).reshape(n, ppb, -1)
                )

    def scatter(self, payloads: torch.Tensor, page_ids: Any) -> TransferHandle:
        """Start copying host payloads (one row per block) into the pages of ``page_ids``.

        On an accelerator, chunk i+1 travels to the device while chunk i is
        spread into the layers; one event per layer is recorded after the last
        chunk, so ``wait_layer(i)`` lets the engine start on layer i early.
        """
        ids = self._page_ids(page_ids)
        self._check_host(payloads, ids.shape[0])
        with self._start_lock:
            return self._start_scatter(payloads, ids)

    def _start_scatter(self, payloads: torch.Tensor, ids: torch.Tensor) -> TransferHandle:
        blocks = ids.shape[0]
        step = self._chunk_blocks
        if not self._accelerated:
            for start in range(0, blocks, step):
                stop = min(blocks, start + step)
                self._spread(payloads[start:stop], ids[start:stop].reshape(-1), None)
            return TransferHandle(payloads, [], None, self._module)
        work, copy = self._streams()
        dev_ids = ids.to(self.device, non_blocking=True)
        caller = self._module.current_stream(self.device)
        work.wait_stream(caller)
        copy.wait_stream(caller)
        # Made on the caller's stream, read on the work stream: without this the caching
        # allocator hands its memory to the next call's ids while this call still reads
        # them, and pages land in the wrong place (seen with back-to-back scatters).
        dev_ids.record_stream(work)
        events: list[Any] = []
        chunks = list(range(0, blocks, step))
        for c, start in enumerate(chunks):
            stop = min(blocks, start + step)
            buf = self._buffers[c % 2][: stop - start]
            with self._module.stream(copy):
                if self._buffer_free[c % 2] is not None:
                    copy.wait_event(self._buffer_free[c % 2])
                buf.copy_(payloads[start:stop], non_blocking=True)
                arrived = self._event(copy)
            with self._module.stream(work):
                work.wait_event(arrived)
                last = c == len(chunks) - 1
                self._spread(buf, dev_ids[start:stop].reshape(-1), events if last else None)
                self._buffer_free[c % 2] = self._event(work)
        return TransferHandle(payloads, events, self._event(work), self._module)

    def _spread(
        self, staging: torch.Tensor, page_ids: torch.Tensor, events: list[Any] | None
    ) -> None:
        """Copy (blocks, payload) rows into the pages ``page_ids``, layer by layer."""
        n = staging.shape[0]
        ppb = self.pages_per_block
        staged = staging.view(n, self.num_layers, ppb, self.tile_bytes)
        for layer, pages in enumerate(self._flat):
            src = staged[:, layer].reshape(n * ppb, self.tile_bytes)
            if self.block_dim == 0:
                pages.index_copy_(0, page_ids, src)
            else:
                outer = pages.shape[0]
                pages.index_copy_(1, page_ids, src.view(n * ppb, outer, -1).permute(1, 0, 2))
            if events is not None:
                events.append(self._event(self._streams()[0]))

    def _streams(self) -> tuple[Any, Any]:
        """The work and copy streams, and two staging buffers, made on first use."""
        if self._work_stream is None:
            self._work_stream = self._module.Stream()
            self._copy_stream = self._module.Stream()
            rows = min(self._chunk_blocks, self.num_pages)
            self._buffers = [
                torch.empty((rows, self.payload_bytes), dtype=torch.uint8, device=self.device)
                for _ in range(2)
            ]
        return self._work_stream, self._copy_stream

    def _event(self, stream: Any) -> Any:
        ev = self._module.Event()
        ev.record(stream)
        return ev


def _integer_ids(page_ids: Any) -> bool:
    """Whether ``page_ids`` holds integers (float ids were truncated to other pages)."""
    if isinstance(page_ids, torch.Tensor):
        return page_ids.numel() == 0 or not (
            page_ids.dtype == torch.bool or page_ids.is_floating_point() or page_ids.is_complex()
        )
    array = np.asarray(page_ids)
    return array.size == 0 or array.dtype.kind in "iu"
