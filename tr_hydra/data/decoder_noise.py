"""The image decoders' own lines about damaged files kept off stderr.

nvImageCodec's parsers, libjpeg-turbo and nvJPEG print about a truncated or damaged JPEG
(``[jpeg_parser] Invalid marker``, ``Premature end of JPEG data``) from DALI's own threads,
straight to fd 2, while batches decode ahead: no window around a call can catch them, and
DALI's log level (``DALI_NVIMGCODEC_LOG_LEVEL``) goes no lower than printing errors. tr_hydra
says which files it skips in one line of its own (``data.skip_corrupt``), so while a source of
encoded files lives, the process's fd 2 goes through a pipe that drops those lines and passes
everything else on."""
from __future__ import annotations

import atexit
import contextlib
import os
import re
import stat
import sys
import tempfile
import threading

# what the image decoders (nvImageCodec's parsers, libjpeg-turbo's warnings, nvJPEG) print
# about a damaged file, from their own threads, straight to fd 2
DECODER_NOISE = re.compile(
    rb"\[\w*(?:parser|jpeg|decoder|nvimgcodec|png|tiff|webp|opencv)\w*\]|Premature end of JPEG"
    rb"|Corrupt JPEG data|Invalid JPEG file structure|Bogus marker length|Unsupported marker type"
    rb"|JPEG datastream contains no image|Not a JPEG file|Bogus Huffman table|Huffman table 0x"
    rb"|Warning: unknown JFIF revision|libpng (?:warning|error)", re.IGNORECASE)


class DecoderNoiseFilter:
    """The process's fd 2 through a pipe while sources of encoded files live: the decoders'
    own lines about damaged files (printed from DALI's threads, while batches decode ahead,
    so no window around a call can catch them) are dropped; everything else is passed on
    as it comes (a line at a time; a partial line with a carriage return, a progress bar,
    at once). tr_hydra says which files it skips, in one line of its own. If something else
    takes fd 2 meanwhile (a test's capture), the filter ends and fd 2 is left to it."""

    _lock = threading.Lock()
    _users = 0
    _active: "DecoderNoiseFilter | None" = None

    def __init__(self):
        sys.stderr.flush()
        self.dropped = 0
        self.out = os.dup(2)
        r, w = os.pipe()
        self.pipe = os.fstat(w).st_ino
        os.dup2(w, 2)
        os.close(w)
        self.r = r
        self.thread = threading.Thread(target=self._pump, name="tr_hydra-stderr-filter", daemon=True)
        self.thread.start()

    @classmethod
    def acquire(cls) -> None:
        with cls._lock:
            f = cls._active
            if f is not None and not f.serving():  # fd 2 was taken over: start again on the new one
                f.stop()
                cls._active = f = None
            if f is None:
                try:
                    cls._active = cls()
                except OSError:  # no fd 2, no pipe: the lines get through, nothing else changes
                    cls._active = None
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        with cls._lock:
            if cls._users == 0:
                return
            cls._users -= 1
            if cls._users == 0 and cls._active is not None:
                cls._active.stop()
                cls._active = None

    def _on_fd2(self) -> bool:
        try:
            st = os.fstat(2)
        except OSError:
            return False
        return stat.S_ISFIFO(st.st_mode) and st.st_ino == self.pipe

    def serving(self) -> bool:
        """Whether fd 2 is still this filter's pipe, and the filter reads it."""
        return self._on_fd2() and self.thread.is_alive()

    def _write(self, data: bytes) -> None:
        while data:
            try:
                n = os.write(self.out, data)
            except OSError:
                return
            data = data[n:]

    def _pass(self, lines: bytes) -> None:
        keep = []
        for line in lines.splitlines(keepends=True):
            if DECODER_NOISE.search(line):
                self.dropped += 1
            else:
                keep.append(line)
        if keep:
            self._write(b"".join(keep))

    def _pump(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self.r, 65536)
            except OSError:
                break
            if not chunk:  # no writer left
                break
            buf += chunk
            cut = max(buf.rfind(b"\n"), buf.rfind(b"\r"))
            if cut >= 0:
                self._pass(buf[:cut + 1])
                buf = buf[cut + 1:]
            if len(buf) > 65536:
                self._pass(buf)
                buf = b""
        if buf:
            self._pass(buf)

    def stop(self) -> None:
        """fd 2 back as it was (if it is still the pipe); the pipe, left without a writer, ends
        the thread once drained. A process that inherited the pipe keeps it open: the thread
        then serves it until that one ends."""
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        if self._on_fd2():
            try:
                os.dup2(self.out, 2)
            except OSError:
                pass
        self.thread.join(timeout=2.0)
        if not self.thread.is_alive():
            for fd in (self.r, self.out):
                with contextlib.suppress(OSError):
                    os.close(fd)


@atexit.register
def _restore_stderr() -> None:
    while DecoderNoiseFilter._users:
        DecoderNoiseFilter.release()


@contextlib.contextmanager
def native_stderr_kept_on_success():
    """DALI's decoders print their own lines to the C-level stderr before raising; those would
    break the one-line error. Capture them: pass them on when the run succeeds, drop them when it
    fails (the exception, turned into a DataError, says what went wrong)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                tmp.seek(0)
                text = tmp.read()
                if text:
                    sys.stderr.write(text.decode(errors="replace"))
