"""Point-to-point transfer of activations (forward) and input gradients (backward) between
adjacent pipeline stages, one ``Link`` per peer and direction; the interpreter
(zfunc.pipeline.interpreter) owns four of them per stage."""
from __future__ import annotations

from collections import deque

import torch

from .. import dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
ACT, GRAD = 0, 1  # tags: activations go forward, gradients come back


class Link:
    """Point-to-point transfers with one peer in one direction; tensor shapes sent the first time
    and cached (they are the same for every micro-batch), so later transfers carry data only.

    Once the shapes are known, a receiving link posts its next receives ahead (``AHEAD``, within
    the run's count, ``expect``): the data moves while this stage computes, instead of after it
    asks, which would put a transfer on the critical path of every micro-batch."""

    AHEAD = 2

    def __init__(self, peer: int, tag: int):
        self.peer, self.tag = peer, tag
        self.device = dist.device_of()  # nccl moves GPU tensors only: shape codes and buffers too
        self.meta: list[tuple[torch.dtype, tuple]] | None = None
        self.pending: list = []  # sends in flight
        self.posted: deque = deque()  # receives in flight, oldest first
        self.left = 0  # receives of this run not posted yet

    def send(self, tensors: tuple) -> None:
        if self.meta is None:
            self.meta = [(t.dtype, tuple(t.shape)) for t in tensors]
            code = [len(tensors)]
            for t in tensors:
                code += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
            code = torch.tensor(code, dtype=torch.int64, device=self.device)
            self.pending.append(dist.send_start(torch.tensor([code.numel()], dtype=torch.int64, device=self.device),
                                                self.peer, self.tag))
            self.pending.append(dist.send_start(code, self.peer, self.tag))
        for t in tensors:
            self.pending.append(dist.send_start(t.detach(), self.peer, self.tag))

    def expect(self, receives: int) -> None:
        """This run receives ``receives`` times on this link: post the first ones now."""
        self.left = receives
        self._post()

    def _post(self) -> None:
        while self.meta is not None and self.left > 0 and len(self.posted) < self.AHEAD:
            self.posted.append([dist.recv_start(torch.empty(shape, dtype=dtype, device=self.device), self.peer, self.tag)
                                for dtype, shape in self.meta])
            self.left -= 1

    def recv(self) -> tuple:
        if self.meta is None:
            n = dist.recv(torch.zeros(1, dtype=torch.int64, device=self.device), self.peer, self.tag)
            code = dist.recv(torch.zeros(int(n), dtype=torch.int64, device=self.device), self.peer, self.tag).tolist()
            meta, k = [], 1
            for _ in range(code[0]):
                dtype, ndim = _DTYPES[code[k]], code[k + 1]
                meta.append((dtype, tuple(code[k + 2: k + 2 + ndim])))
                k += 2 + ndim
            self.meta = meta
            self._post()  # what ``expect`` could not post before the shapes were known
        out = tuple(p.wait() for p in self.posted.popleft())
        self._post()
        return out

    def finish(self) -> None:
        while self.pending:
            self.pending.pop(0).wait()
