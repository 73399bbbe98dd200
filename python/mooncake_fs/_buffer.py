"""Raw addresses of Python buffers, for the VM ioctls (CPython, ctypes only).

``pinned(obj)`` takes a C-contiguous buffer export of any object with the
buffer protocol (bytes, bytearray, memoryview, mmap, array.array, numpy
arrays, ctypes arrays), read-only or writable, and yields its address and
length. The export is held for the duration of the ``with`` block, so the
exporter can neither resize nor free the memory while the daemon copies.
"""

import ctypes
from contextlib import contextmanager

_PyBUF_WRITABLE = 0x0001
_PyBUF_ND = 0x0008
_PyBUF_STRIDES = 0x0010 | _PyBUF_ND
_PyBUF_C_CONTIGUOUS = 0x0020 | _PyBUF_STRIDES


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_api = ctypes.pythonapi
_get_buffer = _api.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = _api.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None

_bytes_new = _api.PyBytes_FromStringAndSize
_bytes_new.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_new.restype = ctypes.py_object
_bytes_data = _api.PyBytes_AsString
_bytes_data.argtypes = (ctypes.py_object,)
_bytes_data.restype = ctypes.c_void_p


@contextmanager
def pinned(obj, writable=False):
    """Yield (address, nbytes) of obj's C-contiguous buffer.

    Raises BufferError (or TypeError, ValueError from the exporter) when obj
    is not a C-contiguous buffer, or is read-only and writable is True.
    """
    view = _PyBuffer()
    flags = _PyBUF_C_CONTIGUOUS | (_PyBUF_WRITABLE if writable else 0)
    _get_buffer(obj, ctypes.byref(view), flags)
    try:
        yield (view.buf or 0), view.len
    finally:
        _release_buffer(ctypes.byref(view))


@contextmanager
def pinned_all(objs, writable=False):
    """pinned for every obj of a list at once: yield [(address, nbytes)],
    the exports held until the block ends (one context, not one each)."""
    views = (_PyBuffer * len(objs))()
    flags = _PyBUF_C_CONTIGUOUS | (_PyBUF_WRITABLE if writable else 0)
    got, out = 0, []
    try:
        for obj in objs:
            view = views[got]
            _get_buffer(obj, ctypes.byref(view), flags)
            got += 1
            out.append((view.buf or 0, view.len))
        yield out
    finally:
        for i in range(got):
            _release_buffer(ctypes.byref(views[i]))


def new_bytes(n):
    """Return (b, address): a new, unshared bytes object of n bytes whose
    contents the caller fills through address before anyone else sees b.
    For n == 0 the address is 0."""
    if n < 0:
        raise ValueError("negative size")
    if n == 0:
        return b"", 0
    b = _bytes_new(None, n)
    return b, _bytes_data(b)
