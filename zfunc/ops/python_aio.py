"""The ``python`` back end of zfunc.ops.aio: the compiled ``Handle``'s interface in plain Python
(a thread pool doing ``os.preadv``/``os.pwrite``, buffered), so asynchronous file I/O works on any
machine, with no compiler."""
from __future__ import annotations

import ctypes
import errno as _errno
import os
from concurrent.futures import Future, ThreadPoolExecutor


class _PyRequest:
    __slots__ = ("write", "atomic", "fsync", "path", "io_path", "fd", "extra_fds", "nbytes",
                 "offset", "futures")

    def __init__(self, write, atomic, fsync, path, nbytes, offset):
        self.write, self.atomic, self.fsync = write, atomic, fsync
        self.path, self.nbytes, self.offset = path, nbytes, offset
        self.io_path = path + ".partial" if atomic else path
        self.fd = -1
        self.extra_fds: list[int] = []  # one per further stream: separate readahead state
        self.futures: list[Future] = []

    def close(self) -> None:
        for fd in [self.fd, *self.extra_fds]:
            if fd >= 0:
                os.close(fd)
        self.fd, self.extra_fds = -1, []


class _Failure(Exception):
    def __init__(self, err: int, what: str, eof: bool = False):
        super().__init__(what)
        self.err, self.what, self.eof = err, what, eof


def _describe(write: bool, nbytes: int, offset: int) -> str:
    return f"{'writing' if write else 'reading'} {nbytes} bytes at offset {offset}"


class PythonHandle:
    """Same interface as the compiled ``Handle``, in buffered I/O: each request is
    cut into ``thread_count`` contiguous streams (each its own descriptor, so
    kernel readahead sees sequential reads), moved ``block_size`` at a time on a
    pool of ``thread_count * queue_depth`` threads shared by all requests."""

    backend = "python"

    def __init__(self, block_size, queue_depth, thread_count, single_submit, overlap_events):
        self.block_size, self.queue_depth, self.thread_count = block_size, queue_depth, thread_count
        self.single_submit, self.overlap_events = single_submit, overlap_events
        self._pool = ThreadPoolExecutor(max_workers=min(64, queue_depth * thread_count),
                                        thread_name_prefix="zfunc-aio")
        self._requests: list[_PyRequest] = []
        self._inject: tuple[int, int] | None = None

    def _inject_error(self, err: int, after_bytes: int = 0) -> None:
        self._inject = (err, after_bytes)

    def broken(self) -> bool:
        return False

    def pread(self, addr, nbytes, path, offset=0):
        self._submit(False, addr, nbytes, path, offset, False, False)

    def pwrite(self, addr, nbytes, path, offset=0, atomic=False, fsync=False):
        self._submit(True, addr, nbytes, path, offset, atomic, fsync)

    def _submit(self, write, addr, nbytes, path, offset, atomic, fsync):
        if offset < 0:
            raise ValueError("offset must be >= 0")
        req = _PyRequest(write, write and atomic, write and fsync, path, nbytes, offset)
        how = "writing" if write else "reading"
        try:
            if write:
                flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if req.atomic else 0)
                req.fd = os.open(req.io_path, flags, 0o644)
            else:
                req.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            msg = f"{os.strerror(e.errno)} while opening for {how} ({_describe(write, nbytes, offset)})"
            parent = os.path.dirname(path)
            if e.errno == _errno.ENOENT and write and parent and not os.path.isdir(parent):
                msg += f"; directory '{parent}' does not exist"
            if req.atomic:
                msg += f"; temporary '{req.io_path}'"
            raise OSError(e.errno, msg, path) from None
        if not write:
            size = os.fstat(req.fd).st_size
            if nbytes and offset + nbytes > size:
                os.close(req.fd)
                raise EOFError(f"short read from '{path}': cannot read {nbytes} bytes at "
                               f"offset {offset}, the file has only {size} bytes")
        inject, self._inject = self._inject, None
        view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B") if nbytes else None
        streams = min(self.thread_count, -(-nbytes // self.block_size))
        if streams:
            span = -(-nbytes // streams // self.block_size) * self.block_size
            try:
                for i, start in enumerate(range(0, nbytes, span)):
                    fd = req.fd
                    if i:
                        fd = os.open(req.io_path, (os.O_WRONLY if write else os.O_RDONLY) |
                                     os.O_CLOEXEC)
                        req.extra_fds.append(fd)
                    if not write:  # a larger readahead window for this stream
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    req.futures.append(self._pool.submit(
                        self._transfer, fd, write, view[start:start + span], offset + start,
                        self.block_size, inject and (inject[0], inject[1] - start)))
            except OSError:
                for f in req.futures:
                    f.exception()  # nothing may still touch the buffer when we raise
                req.close()
                if req.atomic:
                    os.unlink(req.io_path)
                raise
        self._requests.append(req)

    @staticmethod
    def _transfer(fd, write, view, offset, block, inject):
        """Move `view` to/from `offset`, `block` bytes per call; `inject` = (errno,
        bytes that succeed first) for fault injection."""
        done, n = 0, len(view)
        while done < n:
            k = min(block, n - done)
            try:
                if inject and done + k > inject[1]:
                    raise OSError(inject[0], os.strerror(inject[0]))
                got = 0
                while got < k:
                    r = (os.pwrite(fd, view[done + got:done + k], offset + done + got) if write
                         else os.preadv(fd, [view[done + got:done + k]], offset + done + got))
                    if r == 0:
                        if write:
                            raise OSError(_errno.EIO, os.strerror(_errno.EIO))
                        raise _Failure(0, f"got {got} of {k} bytes at offset {offset + done} "
                                          "(end of file)", eof=True)
                    got += r
            except OSError as e:
                err = e.errno or _errno.EIO
                raise _Failure(err, f"{os.strerror(err)} while "
                                    f"{_describe(write, k, offset + done)}") from None
            done += k

    def poll(self) -> int:
        return sum(1 for r in self._requests if not all(f.done() for f in r.futures))

    def wait(self) -> int:
        requests, self._requests = self._requests, []
        failures: list[BaseException] = []
        for req in requests:
            failure = None
            for f in req.futures:
                exc = f.exception()
                if exc is not None and failure is None:
                    failure = exc
            try:
                failure = self._finish(req, failure)
            finally:
                req.close()
            if failure is not None:
                failures.append(failure)
        if failures:
            first = failures[0]
            if len(failures) > 1:
                more = f" (and {len(failures) - 1} more failed requests)"
                first = (EOFError(first.args[0] + more) if isinstance(first, EOFError)
                         else OSError(first.errno, first.strerror + more, first.filename))
            raise first
        return len(requests)

    @staticmethod
    def _finish(req: _PyRequest, failure: BaseException | None) -> BaseException | None:
        """Commit or roll back an atomic write; turn a failure into the exception to raise."""
        if failure is not None and not isinstance(failure, _Failure):
            failure = _Failure(_errno.EIO, f"{type(failure).__name__}: {failure} while "
                                           f"{_describe(req.write, req.nbytes, req.offset)}")
        if failure is None and req.write and (req.atomic or req.fsync):
            try:
                os.fsync(req.fd)
            except OSError as e:
                failure = _Failure(e.errno, f"{e.strerror} while fsync after "
                                            f"{_describe(True, req.nbytes, req.offset)}")
        if req.atomic:
            if failure is None:
                try:
                    os.rename(req.io_path, req.path)
                    dfd = os.open(os.path.dirname(os.path.abspath(req.path)), os.O_RDONLY)
                    try:
                        os.fsync(dfd)
                    finally:
                        os.close(dfd)
                except OSError as e:
                    failure = _Failure(e.errno, f"{e.strerror} while renaming "
                                                f"'{req.io_path}' to '{req.path}'")
            if failure is not None:
                try:
                    os.unlink(req.io_path)
                except FileNotFoundError:
                    pass
        if failure is None:
            return None
        if failure.eof:
            return EOFError(f"short read from '{req.path}': {failure.what}")
        msg = failure.what
        if req.atomic:
            msg += (f" of temporary '{req.io_path}'; the temporary was removed and "
                    f"'{req.path}' was not written")
        return OSError(failure.err, msg, req.path)

    def close(self):
        self._pool.shutdown(wait=True)
