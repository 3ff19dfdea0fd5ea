"""Request streams: one request's tokens, from the worker threads that produce them to the client that reads them.

The loop: the controller creates a `RequestStream` when it admits a request and pushes every
`TokenChunk` into it (`push`, from whichever worker thread holds the request, or the request's error).
The client reads it either blocking (`next_chunk`, iteration, `collect`) or on an asyncio event loop
(`async_chunks`: the chunks pushed so far move to an `asyncio.Queue`, later ones are handed to the loop
with `call_soon_threadsafe`).

Inputs: chunks and errors (`push`, never blocks). Outputs: the same, in order, once each; the stream
ends after the chunk with a `finish_reason` or after an error. What blocks: only the reader
(`next_chunk` waits on a condition variable, with an optional timeout). `cancel()` (or leaving
`async_chunks` early) calls the cancel callback the stream was made with (the controller's `cancel`),
which ends the stream with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import AsyncGenerator, Callable

from jaxserve.core.request import TokenChunk

__all__ = ["RequestStream"]


class RequestStream:
    """The token stream of one request: iterate (blocking) for `TokenChunk`s; `cancel()` to abort."""

    def __init__(self, request_id: str, cancel: Callable[[str], None]) -> None:
        """`cancel(request_id)` aborts the request wherever it is (the controller's `cancel`)."""
        self.request_id = request_id
        self._cancel = cancel
        self._cond = threading.Condition()
        self._items: collections.deque[TokenChunk | BaseException] = collections.deque()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue[TokenChunk | BaseException]] | None = None
        self.finished = False

    def push(self, item: TokenChunk | BaseException) -> None:
        """Hand the reader a chunk (or the request's error); anything after the stream ended is dropped."""
        with self._cond:
            if self.finished:
                return
            if isinstance(item, BaseException) or item.finish_reason is not None:
                self.finished = True
            if self._async is not None:
                loop, queue = self._async
                loop.call_soon_threadsafe(queue.put_nowait, item)
            else:
                self._items.append(item)
                self._cond.notify_all()

    def _attach_async(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue[TokenChunk | BaseException]:
        queue: asyncio.Queue[TokenChunk | BaseException] = asyncio.Queue()
        with self._cond:
            while self._items:
                queue.put_nowait(self._items.popleft())
            self._async = (loop, queue)
        return queue

    async def async_chunks(self) -> AsyncGenerator[TokenChunk, None]:
        """The chunks on the running event loop; leaving the loop early (or cancelling the task) cancels."""
        queue = self._attach_async(asyncio.get_running_loop())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not self.finished:
                self.cancel()

    def next_chunk(self, timeout_s: float | None = None) -> TokenChunk | None:
        """The next chunk; None at the end of the stream. Raises the request's error, or TimeoutError."""
        with self._cond:
            if not self._items and self.finished:
                return None
            if not self._cond.wait_for(lambda: bool(self._items), timeout=timeout_s):
                raise TimeoutError(f"no tokens for {self.request_id!r} within {timeout_s} s")
            item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> TokenChunk:
        chunk = self.next_chunk()
        if chunk is None:
            raise StopIteration
        return chunk

    def collect(self, timeout_s: float | None = None) -> tuple[list[int], TokenChunk]:
        """Every token id and the final chunk (blocking)."""
        ids: list[int] = []
        while True:
            chunk = self.next_chunk(timeout_s)
            if chunk is None:
                raise RuntimeError("stream ended without a final chunk")
            ids.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                return ids, chunk

    def cancel(self) -> None:
        self._cancel(self.request_id)
