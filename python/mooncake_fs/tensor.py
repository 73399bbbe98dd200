"""PyTorch tensors in mooncake-fs: one copy each way, for CPU and GPU memory.

    from mooncake_fs import tensor as mt
    mt.put_tensor("/mnt/mooncake/w", t)                # CPU: PUT_VM, CUDA: PUT_CUDA
    t2 = mt.get_tensor("/mnt/mooncake/w", device="cuda:0")
    mt.get_tensor("/mnt/mooncake/w", out=t2)           # into an existing tensor
    mt.get_tensor_range("/mnt/mooncake/w", out=row, offset=4096)
    mt.save_state_dict("/mnt/mooncake/ckpt", model.state_dict())
    sd = mt.load_state_dict("/mnt/mooncake/ckpt", device="cuda")

    mt.batch_put_tensor(["/mnt/mooncake/kv/b0", ...], [t0, ...])  # one call per 64
    mt.batch_get_tensor(["/mnt/mooncake/kv/b0", ...], out=[o0, ...])
    work = mt.batch_get_tensor(paths, out=outs, async_op=True)  # in the daemon;
    ...                                                          # build the next call
    work.wait()                                                  # outs are filled

The object holds the tensor's bytes in C order; its dtype and shape are
its meta, the xattr ``user.mooncake.meta`` ("dtype=float32 shape=2,3,4";
"shape=" for a 0-d tensor), stored with the bytes in the same call
(PUT_KEY, ABI 1.3) so no reader sees one without the other
(``getfattr -d`` shows it). Objects written by older clients carry
``user.mooncake.dtype`` and ``user.mooncake.shape`` instead; the readers
take either. A put or get is one call through the directory handle this
module keeps open per directory; a get with out= checks the meta in the
daemon, in that same call. CUDA tensors name their memory by the CUDA
IPC handle of the caching allocator's block that holds them: the daemon
opens it once per process and copies between it and the store on its own
stream (see ``mooncake_fs.cudadrv``). Before each call the tensor's current
stream is synchronized, so kernels queued on it that write (put) or still
use (get) the tensor are done; work on other streams is the caller's to
finish. After a get returns, the data is in place.

torch is imported on first use; the rest of the package does not need it.
The functions without "tensor" in their name (dtype_name, format_shape,
parse_shape, escape_key, unescape_key, ...) need neither torch nor a mount.
"""

import errno
import itertools
import operator
import os
import re
import threading
from array import array
from collections import OrderedDict

from . import _abi
from . import client as _client
from .client import BatchError, Directory, File, key_fits, overlapped, spans_overlap

DTYPE_XATTR = "user.mooncake.dtype"
SHAPE_XATTR = "user.mooncake.shape"
META_XATTR = "user.mooncake.meta"

# Canonical dtype names (as torch prints them, less "torch.") and their
# sizes in bytes. Names torch knows but this table does not are accepted
# too (their size then comes from torch).
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}
# torch's other names of the same dtypes.
ALIASES = {
    "float": "float32", "double": "float64", "half": "float16",
    "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32",
    "long": "int64", "int": "int32", "short": "int16",
}
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_QUANTIZED = re.compile(r"qu?int")


class TensorFormatError(ValueError):
    """The object's dtype/shape attributes are missing, malformed, or do not
    match its size."""


# --- pure helpers (no torch) ---


def dtype_name(dtype):
    """Canonical name of a torch dtype (or of a name of one): "float32",
    "bfloat16", ... ValueError for names that are not dtypes we can store
    as plain bytes (quantized types)."""
    s = str(dtype)
    if s.startswith("torch."):
        s = s[len("torch."):]
    s = ALIASES.get(s, s)
    if not _NAME.match(s):
        raise ValueError(f"dtype {dtype!r}: not a dtype name")
    if _QUANTIZED.match(s):
        raise ValueError(f"dtype {s}: quantized tensors are not supported (they carry scales and zero points)")
    return s


def format_shape(shape):
    """"2,3,4" for shape (2, 3, 4); "" for a 0-d tensor."""
    dims = []
    for d in shape:
        try:
            if isinstance(d, bool):
                raise TypeError
            d = operator.index(d)
        except TypeError:
            raise ValueError(f"shape {tuple(shape)!r}: dimensions must be integers") from None
        if d < 0:
            raise ValueError(f"shape {tuple(shape)!r}: negative dimension")
        dims.append(str(d))
    return ",".join(dims)


def parse_shape(value):
    """Inverse of format_shape; value may be bytes (from getxattr)."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise TensorFormatError(f"shape {bytes(value)!r}: not ASCII") from None
    s = value.strip()
    if not s:
        return ()
    dims = []
    for part in s.split(","):
        part = part.strip()
        if not part.isdigit():
            raise TensorFormatError(f"shape {value!r}: {part!r} is not a non-negative integer")
        dims.append(int(part))
    return tuple(dims)


def parse_dtype(value):
    """Canonical dtype name from an xattr value (bytes or str)."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise TensorFormatError(f"dtype {bytes(value)!r}: not ASCII") from None
    try:
        return dtype_name(value.strip())
    except ValueError as e:
        raise TensorFormatError(str(e)) from None


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def expected_nbytes(dtype, shape, itemsize=None):
    """Bytes of a C-order tensor of this dtype name and shape (itemsize
    overrides the table, for dtypes it does not list)."""
    if itemsize is None:
        name = dtype_name(dtype)
        if name not in ITEMSIZE:
            raise ValueError(f"dtype {name}: size unknown; pass itemsize")
        itemsize = ITEMSIZE[name]
    return numel(shape) * itemsize


def xattrs_for(dtype, shape):
    """{xattr name: value bytes} describing a tensor."""
    return {DTYPE_XATTR: dtype_name(dtype).encode(), SHAPE_XATTR: format_shape(shape).encode()}


def mismatch(want_dtype, want_shape, dtype, shape, contiguous, nbytes, want_nbytes):
    """Why a tensor (dtype, shape, contiguous, nbytes) cannot receive an
    object of want_dtype/want_shape/want_nbytes; None if it can."""
    problems = []
    if dtype_name(dtype) != dtype_name(want_dtype):
        problems.append(f"dtype {dtype_name(dtype)}, object has {dtype_name(want_dtype)}")
    if tuple(shape) != tuple(want_shape):
        problems.append(f"shape {tuple(shape)}, object has {tuple(want_shape)}")
    if not contiguous:
        problems.append("not contiguous")
    if nbytes != want_nbytes:
        problems.append(f"{nbytes} bytes, object has {want_nbytes}")
    return "; ".join(problems) or None


_metas = {}


def format_meta(dtype, shape):
    """The meta of a tensor: "dtype=float32 shape=2,3,4"."""
    k = (dtype, shape)  # a torch.Size hashes and compares as its tuple
    try:
        m = _metas.get(k)
    except TypeError:  # a list
        k = (dtype, tuple(shape))
        m = _metas.get(k)
    if m is None:
        m = f"dtype={dtype_name(dtype)} shape={format_shape(shape)}".encode()
        if len(_metas) < 4096:
            _metas[k] = m
    return m


def parse_meta(value):
    """(dtype name, shape) from a meta; TensorFormatError if it is not one
    format_meta makes."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise TensorFormatError(f"meta {bytes(value)!r}: not ASCII") from None
    parts = dict(p.partition("=")[::2] for p in value.split(" ") if p)
    if set(parts) != {"dtype", "shape"} or len(value.split(" ")) != 2:
        raise TensorFormatError(f"meta {value!r}: not a tensor's (want 'dtype=NAME shape=D0,D1,...')")
    return parse_dtype(parts["dtype"]), parse_shape(parts["shape"])


def escape_key(name):
    """File name for a state-dict key: "%" -> "%25", "/" -> "%2F", NUL ->
    "%00", and the names "." and ".." -> "%2E", "%2E%2E"; everything else
    (dots included) is kept, so "layer.0.weight" stays as it is."""
    if not isinstance(name, str):
        raise TypeError(f"state dict key {name!r}: want str")
    if not name:
        raise ValueError("empty state dict key")
    if name in (".", ".."):
        return "%2E" * len(name)
    return name.replace("%", "%25").replace("/", "%2F").replace("\0", "%00")


_ESC = re.compile(r"%(.{0,2})", re.S)


def unescape_key(fname):
    """Inverse of escape_key; ValueError for a name it cannot have made."""

    def sub(m):
        code = m.group(1)
        if len(code) != 2 or not all(c in "0123456789abcdefABCDEF" for c in code):
            raise ValueError(f"file name {fname!r}: bad escape %{code}")
        return chr(int(code, 16))

    name = _ESC.sub(sub, fname)
    if escape_key(name) != fname:
        raise ValueError(f"file name {fname!r}: not an escaped state dict key (expected {escape_key(name)!r})")
    return name


# --- torch ---


def _torch():
    try:
        import torch  # imported on first use only
    except ImportError as e:
        raise ImportError(f"mooncake_fs.tensor needs PyTorch ({e})") from None
    return torch


def torch_dtype(name):
    """The torch.dtype of a canonical (or alias) dtype name."""
    torch = _torch()
    name = dtype_name(name)
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TensorFormatError(f"dtype {name}: this PyTorch ({torch.__version__}) has no such dtype")
    return dt


_HAS = {}  # what this PyTorch's tensors have, looked at once


def _has(attr):
    h = _HAS.get(attr)
    if h is None:
        h = _HAS[attr] = hasattr(_torch().Tensor, attr)
    return h


def _nbytes(t):
    if _has("nbytes"):
        return t.nbytes  # one call into torch (a PyTorch that has it)
    return t.numel() * t.element_size()


def _device_kind(t):
    if t.is_cuda:
        return "cuda"
    if (t.is_cpu if _has("is_cpu") else t.device.type == "cpu"):  # t.device makes an object: slower
        return "cpu"
    raise ValueError(f"tensor on {t.device}: only CPU and CUDA tensors are supported")


def _source(tensor):
    """The C-contiguous, plain-layout tensor whose memory a put reads:
    tensor itself, or a copy when tensor is a non-contiguous view (or has a
    lazy conjugate/negative bit)."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"want a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor layout {tensor.layout}: only dense (strided) tensors are supported")
    if tensor.is_quantized:
        raise ValueError("quantized tensors are not supported")
    _device_kind(tensor)
    if tensor.is_contiguous() and not (_has("is_conj") and (tensor.is_conj() or tensor.is_neg())):
        return tensor  # its memory as it is (the common case: no copy, no new tensor)
    t = tensor.detach()
    if hasattr(t, "resolve_conj"):
        t = t.resolve_conj().resolve_neg()
    return t.contiguous()


def _check_target(out):
    torch = _torch()
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out: want a torch.Tensor, got {type(out).__name__}")
    if out.layout != torch.strided or out.is_quantized:
        raise ValueError("out: only dense (strided), non-quantized tensors are supported")
    _device_kind(out)
    if not out.is_contiguous():
        raise ValueError("out: not contiguous (read into a contiguous tensor, then copy)")
    if _has("is_conj") and (out.is_conj() or out.is_neg()):
        raise ValueError("out: a lazily conjugated or negated view (use resolve_conj()/resolve_neg())")


class _OnDevice:
    """For a CUDA tensor: its device current, its current stream
    synchronized, and where its memory is in IPC terms."""

    def __init__(self, t, nbytes):
        self.t, self.nbytes = t, nbytes

    def __enter__(self):
        from . import cudadrv

        torch = _torch()
        self._dev = torch.cuda.device(self.t.device)
        self._dev.__enter__()
        try:
            torch.cuda.current_stream().synchronize()
            return cudadrv.ipc_location(self.t.data_ptr(), self.nbytes, self.t.device.index)
        except BaseException:
            self._dev.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        return self._dev.__exit__(*exc)


def _cuda_errors(f, loc, call):
    """Run call(); explain the errnos a daemon gives when it cannot serve
    GPU memory."""
    try:
        return call()
    except OSError as e:
        hints = {
            errno.ENOTTY: "the daemon does not know PUT_CUDA/GET_CUDA (it predates ABI 1.2)",
            errno.ENODEV: f"the daemon cannot use GPU {loc.device.hex()} (no CUDA driver there, or no such GPU)",
        }
        if e.errno not in hints:
            raise
        raise OSError(e.errno, f"{os.strerror(e.errno)}: {hints[e.errno]}", f.name) from None


def _put(f, t, nbytes, exclusive):
    """PUT_VM or PUT_CUDA of contiguous tensor t on File f; (moved, version)."""
    if nbytes == 0:
        return f.put_vm(0, 0, exclusive=exclusive)
    if _device_kind(t) == "cpu":
        return f.put_vm(t.data_ptr(), nbytes, exclusive=exclusive)
    with _OnDevice(t, nbytes) as loc:
        return _cuda_errors(f, loc, lambda: f.put_cuda(loc.handle, loc.dev_off, nbytes, device=loc.device,
                                                       exclusive=exclusive))


def _get(f, out, nbytes, offset):
    """GET_VM or GET_CUDA into contiguous tensor out; bytes read."""
    if nbytes == 0:
        return 0
    if _device_kind(out) == "cpu":
        return f.get_vm(out.data_ptr(), nbytes, offset)[0]
    with _OnDevice(out, nbytes) as loc:
        return _cuda_errors(f, loc, lambda: f.get_cuda(loc.handle, loc.dev_off, nbytes, offset, device=loc.device))[0]


def _open_for_put(path, makedirs):
    try:
        return File(path, "w")
    except FileNotFoundError:
        parent = os.path.dirname(os.fspath(path))
        if not makedirs or not parent:
            raise
        os.makedirs(parent, exist_ok=True)
        return File(path, "w")


def _set_xattrs(f, attrs):
    for name, value in attrs.items():
        try:
            os.setxattr(f.fileno(), name, value)
        except OSError as e:
            if e.errno in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise OSError(e.errno, f"cannot set {name} ({os.strerror(e.errno)}): the daemon must store "
                              f"{DTYPE_XATTR} and {SHAPE_XATTR} (the tensor's bytes were stored)", f.name) from None
            raise


# Directory handles kept open, per directory, for one-call puts and gets.
_MAX_DIRS = 64
_dirs = OrderedDict()
_dirs_lock = threading.Lock()
_dirs_pid = os.getpid()


def _dir_of(path):
    """(Directory, name) for path's parent, kept open (bounded, most
    recently used kept; a dropped handle closes when nothing uses it), or
    (None, None) when path cannot go by name: a
    name too long for one call, a parent that is not there, or a daemon
    older than ABI 1.3. A kept handle serves only while the path still
    names its directory (a stat, which the kernel answers from its cache):
    after a rename or a new directory in its place, the path's directory
    is opened anew."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if not name or not key_fits(name):
        return None, None
    d = _dir_handle(parent)
    return (d, name) if d is not None else (None, None)


def _dir_handle(parent):
    """The kept Directory of parent (an absolute, normal path), as
    _dir_of's, or None."""
    global _dirs_pid
    try:
        st = os.stat(parent)
    except OSError:
        return None
    ident = (st.st_dev, st.st_ino)
    with _dirs_lock:
        if _dirs_pid != os.getpid():
            _dirs.clear()  # a forked child opens its own
            _dirs_pid = os.getpid()
        kept = _dirs.get(parent)
        if kept is not None and kept[0] == ident:
            _dirs.move_to_end(parent)
            return kept[1] if kept[1] is not False else None
    try:
        d = Directory(parent)
        dst = os.fstat(d.fileno())
        abi = d.probe()
    except OSError:
        return None  # not a mount: the file path says why
    if (dst.st_dev, dst.st_ino) != ident or abi < (1, 3):
        d.close()
        d = False
    else:
        d.abi = abi
    with _dirs_lock:
        # Handles dropped here are not closed: a caller may still use one;
        # each closes when the last reference to it goes.
        _dirs.pop(parent, None)
        _dirs[parent] = (ident, d)
        while len(_dirs) > _MAX_DIRS:
            _dirs.popitem(last=False)
    return d if d is not False else None


def _key_arg(t, nbytes, offset=0):
    """A Key argument naming contiguous tensor t's memory (CPU: by address;
    CUDA: by IPC handle, inside _OnDevice)."""
    return _abi.Key(source=_abi.SRC_VM, addr=t.data_ptr() if nbytes else 0, len=nbytes, obj_off=offset)


def _key_call(d, put, name, t, nbytes, meta, flags=0, offset=0):
    """PUT_KEY/GET_KEY of tensor t's memory; returns the Key reply."""
    if nbytes and _device_kind(t) == "cuda":
        with _OnDevice(t, nbytes) as loc:
            a = _abi.Key(source=_abi.SRC_CUDA, addr=loc.dev_off, len=nbytes, obj_off=offset)
            a.h.flags = flags
            _set_gpu(a.gpu, loc)
            return _cuda_errors(d, loc, lambda: d.key_call(put, name, a, meta))
    a = _key_arg(t, nbytes, offset)
    a.h.flags = flags
    return d.key_call(put, name, a, meta)


def _set_gpu(ref, loc):
    import ctypes

    ctypes.memmove(ref.handle, loc.handle, 64)
    ctypes.memmove(ref.device, loc.device, 16)


def put_tensor(path, tensor, *, exclusive=False, makedirs=True):
    """Store a CPU or CUDA tensor at path (a key on a mount), replacing the
    object atomically, its dtype and shape with it (the meta); return the
    version.

    One call, one copy: from CPU memory by address, from GPU memory by IPC
    handle (the tensor's current stream is synchronized first). A
    non-contiguous tensor (a transpose, a strided slice, an expanded view)
    is first copied to a contiguous one on its device - that copy costs
    time and memory; pass .contiguous() tensors to avoid it. exclusive:
    FileExistsError if the key exists. makedirs: create missing parent
    directories."""
    t = _source(tensor)
    nbytes = _nbytes(t)
    meta = format_meta(t.dtype, tuple(t.shape))
    d, name = _dir_of(path)
    if d is None or len(meta) > _abi.MAX_META:
        return _put_tensor_file(path, t, nbytes, exclusive, makedirs)
    flags = _abi.FLAG_EXCL if exclusive else 0
    try:
        return _key_call(d, True, name, t, nbytes, meta, flags).version
    except FileNotFoundError:
        if not makedirs:
            raise
    os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
    return _key_call(d, True, name, t, nbytes, meta, flags).version


def _put_tensor_file(path, t, nbytes, exclusive, makedirs):
    """put_tensor through an open file, with the dtype/shape xattrs: for a
    daemon older than ABI 1.3, a name too long for one call, or a shape
    whose meta passes MAX_META."""
    attrs = xattrs_for(t.dtype, tuple(t.shape))
    with _open_for_put(path, makedirs) as f:
        moved, _ = _put(f, t, nbytes, exclusive)
        if moved != nbytes:
            raise OSError(errno.EIO, f"short put: {moved} of {nbytes} bytes", f.name)
        _set_xattrs(f, attrs)
        return f.stat().version


def tensor_info(path):
    """(dtype name, shape) of a tensor stored at path, from its meta (or
    the dtype/shape xattrs of older clients)."""
    return _info(os.fspath(path))


def _info(target, name=None):
    """(dtype name, shape) from the xattrs of target (a path or an fd)."""
    try:
        return parse_meta(os.getxattr(target, META_XATTR))
    except OSError as e:
        if e.errno != errno.ENODATA:
            raise OSError(e.errno, os.strerror(e.errno), name or target) from None
    vals = {}
    for attr in (DTYPE_XATTR, SHAPE_XATTR):
        try:
            vals[attr] = os.getxattr(target, attr)
        except OSError as e:
            if e.errno == errno.ENODATA:
                raise TensorFormatError(f"{name or target}: no {attr} (not stored by put_tensor)") from None
            raise OSError(e.errno, os.strerror(e.errno), name or target) from None
    return parse_dtype(vals[DTYPE_XATTR]), parse_shape(vals[SHAPE_XATTR])


def _empty(shape, dtype, device):
    torch = _torch()
    t = torch.empty(shape, dtype=dtype, device=device)
    _device_kind(t)
    return t


def _same_device(want, have):
    torch = _torch()
    if isinstance(want, int):
        want = torch.device("cuda", want)
    want = torch.device(want)
    if want.type != have.type:
        return False
    if want.index is None:
        return want.type != "cuda" or have.index == torch.cuda.current_device()
    return want.index == have.index


def get_tensor(path, out=None, device=None):
    """Read the tensor stored at path by put_tensor.

    Without out, a new tensor of the stored dtype and shape is made on
    device (None: torch's default device; "cuda", "cuda:1", 0, "cpu",
    torch.device, ...): two calls, a lookup and the get. With out, it must
    be a contiguous tensor of that dtype and shape (on device, if given);
    it is filled and returned, in one call that the daemon refuses, moving
    nothing, unless the stored meta matches. The data moves in one copy and
    is in place on return. TensorFormatError when the object carries no
    tensor meta or it does not match the object's size."""
    if out is not None:
        _check_target(out)
        if device is not None and not _same_device(device, out.device):
            raise ValueError(f"out is on {out.device}, device={device!r} asked")
    d, name = _dir_of(path)
    if d is None or (out is not None and len(format_meta(out.dtype, tuple(out.shape))) > _abi.MAX_META):
        return _get_tensor_file(path, out, device)
    torch = _torch()
    for _ in range(8):
        if out is not None:
            want, meta, target = _nbytes(out), format_meta(out.dtype, tuple(out.shape)), out
        else:
            info = d.lookup(name)
            if not info.meta:
                return _get_tensor_file(path, out, device)  # an older client's xattrs, or none
            dname, shape = parse_meta(info.meta)
            dtype = torch_dtype(dname)
            want = numel(shape) * torch.empty(0, dtype=dtype).element_size()
            if info.size != want:
                raise TensorFormatError(f"{path}: object has {info.size} bytes, but {dname} {shape} is {want}")
            meta, target = info.meta, _empty(shape, dtype, device)
        try:
            a = _key_call(d, False, name, target, want, meta)
        except OSError as e:
            if e.errno != errno.EBADMSG:
                raise
            if out is not None:
                return _get_tensor_file(path, out, device)  # says what does not fit
            continue  # replaced since the lookup
        if a.size != want:
            raise TensorFormatError(f"{path}: object has {a.size} bytes, but its meta says {want}")
        if a.result != want:
            raise OSError(errno.EIO, f"short get: {a.result} of {want} bytes", path)
        return target
    raise OSError(errno.EAGAIN, "the tensor kept being replaced during the get", path)


def _get_tensor_file(path, out, device):
    """get_tensor through an open file and its xattrs."""
    torch = _torch()
    with File(path) as f:
        dname, shape = _info(f.fileno(), f.name)
        dtype = torch_dtype(dname)
        want = numel(shape) * torch.empty(0, dtype=dtype).element_size()
        size = f.stat().size  # of the version this file reads
        if size != want:
            raise TensorFormatError(f"{f.name}: object has {size} bytes, but {dname} {shape} is {want} "
                                    "(attributes stale, or the object was replaced by something else)")
        if out is None:
            out = _empty(shape, dtype, device)
        else:
            why = mismatch(dname, shape, out.dtype, tuple(out.shape), out.is_contiguous(), _nbytes(out), want)
            if why:
                raise ValueError(f"{f.name}: out does not fit: {why}")
        got = _get(f, out, want, 0)
        if got != want:
            raise OSError(errno.EIO, f"short get: {got} of {want} bytes", f.name)
    return out


def _split(path):
    """(parent, name) of path made absolute and normal; an absolute path
    already normal (a batch's common case) without abspath's work."""
    if path.__class__ is str and path[:1] == "/" and "//" not in path and "/." not in path and path[-1:] != "/":
        parent, _, name = path.rpartition("/")
        return parent or "/", name
    return os.path.split(os.path.abspath(os.fspath(path)))


def _by_parent(paths):
    """{parent: [(i, name)]} of paths, each split once."""
    by_parent = {}
    for i, p in enumerate(paths):
        parent, name = _split(p)
        by_parent.setdefault(parent, []).append((i, name))
    return by_parent


def _batch_groups(paths, by_parent=None):
    """Indexes of paths grouped by directory handle: [(Directory, [(i,
    name)])], one lookup of each directory; paths that cannot go by name
    come back under None. by_parent: _by_parent(paths), when made."""
    if by_parent is None:
        by_parent = _by_parent(paths)
    groups = {}
    for parent, members in by_parent.items():
        fits = [key_fits(name) for _, name in members]
        fit = next((name for (_, name), ok in zip(members, fits) if ok), members[0][1])
        d, _ = _dir_of(os.path.join(parent, fit))
        g = groups.setdefault(id(d) if d else None, (d, []))[1]
        for (i, name), ok in zip(members, fits):
            if d is not None and not ok:
                groups.setdefault(None, (None, []))[1].append((i, name))
            else:
                g.append((i, name))
    return list(groups.values())


def _run_tensor_batch(d, put, names, ts, sizes, metas, extra, ptrs=None, devs=None, in_part=False):
    """Put (put) or get the keys of directory d whose columns are names
    (bytes), ts (contiguous tensors), sizes (their bytes) and metas; extra
    is the put flags (one value for all), or for a get None (whole values:
    FLAG_WHOLE) or the address of a probe byte read after each tensor, one
    per key; ptrs and devs, when the caller has them, the tensors'
    data_ptr() and CUDA device (-1: CPU). Runs them in calls of at most
    MAX_BATCH keys and MAX_GPU_REFS allocations, after synchronizing the
    current stream of every device they use. Returns [(result, version)]
    in order. A batch of more than 2 * MAX_BATCH keys whose calls may
    overlap goes in parts of MAX_BATCH keys, each made ready and sent by
    whichever of IN_FLIGHT threads is free (client.in_parts; in_part: one
    of those, its streams synchronized by the caller, its calls in
    order). Made ready all in one thread, the calls would wait for it
    and the workers woken for the first ones for the GIL."""
    from . import cudadrv

    count = len(ts)
    out = [None] * count
    if not count:
        return out
    if ptrs is None:
        ptrs = [t.data_ptr() for t in ts]
        devs = [t.get_device() if t.is_cuda else -1 for t in ts]
    per = _abi.MAX_BATCH
    if not in_part and count > 2 * per and _client.IN_FLIGHT > 1 and \
            not (len(set(names)) != count if put else spans_overlap(ptrs, sizes)):
        probes = not put and extra is not None
        torch = _torch()
        for ordinal in set(devs):
            if ordinal >= 0:
                # Here: the current stream is this thread's (the parts run
                # in others, whose current streams are the default ones).
                torch.cuda.current_stream(ordinal).synchronize()

        def part(i):
            lo, hi = i * per, min(count, (i + 1) * per)
            return _run_tensor_batch(d, put, names[lo:hi], ts[lo:hi], sizes[lo:hi], metas[lo:hi],
                                     extra[lo:hi] if probes else extra, ptrs[lo:hi], devs[lo:hi], in_part=True)

        parts = _client.in_parts((count + per - 1) // per, part)
        return list(itertools.chain.from_iterable(parts))
    lo, hi = min(devs), max(devs)
    probe = not put and extra is not None
    flags = extra if put else (0 if probe else _abi.FLAG_WHOLE)
    nseg = 2 if probe else 1
    step, room, per = 24 * nseg, _abi.VBATCH_AREA_BYTES, _abi.MAX_BATCH
    seg_gpu, seg_vm, max_refs = _abi.SEG_GPU, _abi.SEG_VM, _abi.MAX_GPU_REFS
    one = count <= per and not probe and min(sizes) > 0 and \
        step * count + sum(map(len, names)) + sum(map(len, metas)) <= room
    locs = None  # (handle, device UUID, offset) of each CUDA tensor
    if one and lo == hi >= 0:
        # One call, all on one device, no empty tensor: its segments made
        # column by column, from the allocations' columns.
        if not in_part:  # (a part's caller synchronized)
            _torch().cuda.current_stream(lo).synchronize()
        refs, idx, offs = cudadrv.handles.locate_columns(ptrs, sizes, lo)
        if len(refs) <= max_refs:
            return d.send_columns(*_gpu_columns(put, names, sizes, metas, flags, refs, idx, offs), versions=True)
        locs = [refs[i] + (off,) for i, off in zip(idx, offs)]  # too many allocations: calls() splits it
    elif one and hi < 0:
        words = [seg_vm] * (3 * count)
        words[1::3] = ptrs
        words[2::3] = sizes
        return d.send_columns(put, b"".join(names), list(map(len, names)), array("Q", words), nseg, flags,
                              b"".join(metas), list(map(len, metas)), (), versions=True)
    if locs is None:
        locs = [None] * count
        if hi >= 0:
            if lo == hi and min(sizes) > 0:
                by_dev = {devs[0]: range(count)}  # the common case: one device, no empty tensor
            else:
                by_dev = {}
                for j, (dv, n) in enumerate(zip(devs, sizes)):
                    if dv >= 0 and n:
                        by_dev.setdefault(dv, []).append(j)
            torch = _torch()
            for ordinal, js in by_dev.items():
                if not in_part:  # (a part's caller synchronized)
                    torch.cuda.current_stream(ordinal).synchronize()
                if js.__class__ is range:
                    locs = cudadrv.handles.locate_many(ptrs, sizes, ordinal)
                    continue
                got = cudadrv.handles.locate_many([ptrs[j] for j in js], [sizes[j] for j in js], ordinal)
                for j, loc in zip(js, got):
                    locs[j] = loc

    def calls():
        pos = 0
        while pos < count:
            refs, gidx, words = [], {}, []
            used, end = 0, pos
            while end < count and end - pos < per:
                used += step + len(names[end]) + len(metas[end])
                if used > room:
                    break
                loc = locs[end]
                if loc is None:
                    n = sizes[end]
                    words += (seg_vm, ptrs[end] if n else 0, n)
                else:
                    ref = loc[:2]
                    g = gidx.get(ref)
                    if g is None:
                        if len(refs) == max_refs:
                            break
                        g = gidx[ref] = len(refs)
                        refs.append(ref)
                    words += (seg_gpu | g, loc[2], sizes[end])
                if probe:
                    words += (seg_vm, extra[end], 1)
                end += 1
            if end == pos:
                raise ValueError(f"{names[pos]!r}: too large for one batch")
            ns, ms = names[pos:end], metas[pos:end]
            args = (put, b"".join(ns), [len(k) for k in ns], array("Q", words), nseg, flags,
                    b"".join(ms), [len(m) for m in ms], refs)
            yield pos, end, lambda args=args: d.send_columns(*args, versions=True)
            pos = end

    todo = calls()
    first = next(todo)
    second = next(todo, None)
    if second is None:
        out[first[0]:first[1]] = first[2]()
        return out
    # Calls of MAX_BATCH keys: while the first are in the daemon the next
    # are built, and the daemon works on several at once. Smaller calls, to
    # overlap the calls of 64 tensors, were slower on the H200 host (32 a
    # call, two at once: 0.35 of the ceiling against 0.39 whole, 2026-12-02;
    # each call's fixed work, its FUSE round trip and GPU streams, is more
    # than the overlap saves). So was a call of 64 cut in two with the
    # second made ready while the first ran, its thread holding the GIL
    # until it was in the daemon (19.6 -> 22.5 us a 256 KiB put, 18.5 ->
    # 21.6 a get, interleaved), though that was 10% faster for 256 KiB CPU
    # tensors on the 2-core VM. Puts of a name twice, and gets into tensors
    # that share bytes, go one call after the other.
    serial = in_part or (len(set(names)) != count if put else spans_overlap(ptrs, sizes))  # a part: in its thread
    todo = itertools.chain((first, second), todo)
    if serial:
        for a, b, send in todo:
            out[a:b] = send()
        return out
    order = []

    def sends():
        for a, b, send in todo:
            order.append((a, b))
            yield send

    for (a, b), res in zip(order, overlapped(sends())):
        out[a:b] = res
    return out


def _gpu_columns(put, names, sizes, metas, flags, refs, idx, offs):
    """send_columns' (and submit_columns') arguments of one call of keys
    with one segment each in CUDA memory: refs, idx and offs as
    locate_columns gives them for the keys' tensors."""
    words = [0] * (3 * len(names))
    words[0::3] = map(_abi.SEG_GPU.__or__, idx)
    words[1::3] = offs
    words[2::3] = sizes
    return (put, b"".join(names), list(map(len, names)), array("Q", words), 1, flags,
            b"".join(metas), list(map(len, metas)), refs)


def _one_dir(paths):
    """(parent, names) when every path is an absolute, normal str path in
    one directory (a batch's common case), its name not starting with a
    dot; else None, for _by_parent and _batch_groups to sort out."""
    p = paths[0] if paths else None
    if p.__class__ is not str or p[:1] != "/" or "//" in p or "/." in p:
        return None
    cut = p.rfind("/") + 1
    prefix = p[:cut]
    # Each test one map over the paths (C loops): a call of 64 paths
    # spent 30 us here in a loop of bytecode on the H200 host.
    if set(map(type, paths)) != {str} or not all(map(str.startswith, paths, itertools.repeat(prefix))):
        return None
    names = list(map(operator.getitem, paths, itertools.repeat(slice(cut, None))))
    if not all(names) or any(map(str.startswith, names, itertools.repeat("."))) or \
            any(map(operator.contains, names, itertools.repeat("/"))):
        return None
    return prefix[:-1] or "/", names


_QDTYPES = None  # this PyTorch's quantized dtypes, looked at once
_TB = None  # torch's C tensor class, whose methods _columns_of maps over tensors
_attr = operator.attrgetter


def _columns_of(ts):
    """_columns_of_each's answer, asked of all the tensors at once when
    they are all CUDA tensors or all CPU tensors: each question is one map
    over the list (a loop in C, no bytecode per tensor), about half the
    cost of asking tensor by tensor on the H200 host (1.5 against 2.6 us a
    tensor); any other list, and any answer that is not the plain one,
    goes tensor by tensor."""
    global _TB
    torch = _torch()
    if _TB is None:
        _TB = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
    tb = _TB
    if not ts or not _has("is_conj") or not _has("is_cpu"):
        return _columns_of_each(ts)
    if set(map(type, ts)) != {torch.Tensor} or set(map(_attr("layout"), ts)) != {torch.strided} or \
            not all(map(tb.is_contiguous, ts)) or any(map(tb.is_neg, ts)):
        return _columns_of_each(ts)
    dts = list(map(_attr("dtype"), ts))
    kinds = set(dts)
    if _QDTYPES is None or not _QDTYPES.isdisjoint(kinds):
        return _columns_of_each(ts)
    # Only a complex tensor has a lazy conjugate: asked only where one is.
    if any(map(_attr("is_complex"), kinds)) and any(map(tb.is_conj, ts)):
        return _columns_of_each(ts)
    if all(map(_attr("is_cuda"), ts)):
        devs = list(map(tb.get_device, ts))
    elif all(map(_attr("is_cpu"), ts)):
        devs = [-1] * len(ts)
    else:
        return _columns_of_each(ts)
    shapes = list(map(_attr("shape"), ts))
    metas = list(map(_metas.get, zip(dts, shapes)))
    if None in metas:  # shapes not seen yet, or not kept (the cache is full)
        metas = [m if m is not None else format_meta(dt, sh) for m, dt, sh in zip(metas, dts, shapes)]
    if max(map(len, metas)) > _abi.MAX_META:
        return _columns_of_each(ts)
    if _has("nbytes"):
        sizes = list(map(_attr("nbytes"), ts))
    else:
        sizes = list(map(operator.mul, map(tb.numel, ts), map(tb.element_size, ts)))
    return metas, sizes, list(map(tb.data_ptr, ts)), devs


def _columns_of_each(ts):
    """(metas, sizes, ptrs, devs) of ts when every one is a torch.Tensor
    (not a subclass) that a batch moves as it is: dense, contiguous, not
    quantized, no lazy conjugate or negative bit, on the CPU or a CUDA
    device (devs: its index, -1 for the CPU), its meta fitting a call;
    else None, and _source / _check_target copy it or say why not. One
    pass, each tensor asked each thing once (a call into torch costs more
    than the key's share of the ioctl)."""
    global _QDTYPES
    torch = _torch()
    if _QDTYPES is None:
        _QDTYPES = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                               if hasattr(torch, n))
    cls, strided, quantized, metas_of = torch.Tensor, torch.strided, _QDTYPES, _metas.get
    conj, cpu, nb = _has("is_conj"), _has("is_cpu"), _has("nbytes")
    metas, sizes, ptrs, devs = [], [], [], []
    for t in ts:
        if t.__class__ is not cls or t.layout is not strided or not t.is_contiguous():
            return None
        if conj and (t.is_conj() or t.is_neg()):
            return None
        dt = t.dtype
        if dt in quantized:
            return None
        if t.is_cuda:
            devs.append(t.get_device())
        elif t.is_cpu if cpu else t.device.type == "cpu":
            devs.append(-1)
        else:
            return None
        shape = t.shape
        m = metas_of((dt, shape)) or format_meta(dt, shape)
        if len(m) > _abi.MAX_META:
            return None
        metas.append(m)
        sizes.append(t.nbytes if nb else t.numel() * t.element_size())
        ptrs.append(t.data_ptr())
    return metas, sizes, ptrs, devs


def _fast_batch(paths, ts, makedirs):
    """(Directory, name bytes, metas, sizes, ptrs, devs) of a batch whose
    paths are in one directory that goes by name and whose tensors are
    plain (_columns_of); None otherwise (the general path)."""
    one = _one_dir(paths)
    if one is None:
        return None
    cols = _columns_of(ts)
    if cols is None:
        return None
    parent, names = one
    keys = list(map(str.encode, names, itertools.repeat("utf-8"), itertools.repeat("surrogateescape")))
    if max(map(len, keys)) > _abi.KEY_KEY_BYTES:
        return None
    # The directory's handle first: where it is kept, one stat (which the
    # kernel answers from its cache) says it still names the directory,
    # and makedirs has nothing to do.
    d = _dir_handle(parent)
    if d is None and makedirs and not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
        d = _dir_handle(parent)
    if d is None:
        return None
    return (d, keys) + cols


def batch_put_tensor(paths, tensors, *, exclusive=False, makedirs=True, check=True, async_op=False):
    """Store many CPU or CUDA tensors, each at its path (put_tensor's rules),
    in one call per 64 keys of one directory: their copies are issued
    together and synchronized once. Returns the list of versions, or with
    check=False the results (bytes written, or -errno) in order; with
    check, BatchError if any failed. With async_op, returns a TensorWork
    at once, whose wait() returns (or raises) that (see TensorWork)."""
    paths, ts = list(paths), list(tensors)
    if len(paths) != len(ts):
        raise ValueError(f"{len(paths)} paths for {len(ts)} tensors")
    flags = _abi.FLAG_EXCL if exclusive else 0
    fast = _fast_batch(paths, ts, makedirs) if paths else None
    if fast is not None:
        d, keys, metas, sizes, ptrs, devs = fast
        if async_op:
            try:
                finish = _submit_tensor_batch(d, True, keys, ts, sizes, metas, flags, ptrs, devs)
            except Exception as e:
                return _done(True, _raiser(e))
            if finish is not None:
                return TensorWork(finish, lambda got: _batch_outcome(paths, got, check, "batch put_tensor"), ts)
        return _done(async_op, lambda: _batch_outcome(
            paths, _run_tensor_batch(d, True, keys, ts, sizes, metas, flags, ptrs, devs), check, "batch put_tensor"))
    return _done(async_op, lambda: _batch_put_general(paths, ts, flags, exclusive, makedirs, check))


def _batch_put_general(paths, ts, flags, exclusive, makedirs, check):
    """batch_put_tensor of any paths and tensors: by directory, copying a
    tensor that cannot go as it is, one by one what cannot go in a batch."""
    ts = [_source(t) for t in ts]
    by_parent = _by_parent(paths)
    if makedirs:
        for parent in by_parent:
            if not os.path.isdir(parent):  # a stat the kernel answers from its cache; mkdir goes to the daemon
                os.makedirs(parent, exist_ok=True)
    results = [None] * len(paths)
    for d, members in _batch_groups(paths, by_parent):
        if d is None:
            for i, _ in members:
                results[i] = _alone(lambda i=i: (_nbytes(ts[i]), put_tensor(paths[i], ts[i], exclusive=exclusive,
                                                                            makedirs=makedirs)))
            continue
        idx, keys, metas = [], [], []
        for i, name in members:
            meta = format_meta(ts[i].dtype, ts[i].shape)
            if len(meta) > _abi.MAX_META:
                results[i] = _alone(lambda i=i: (_nbytes(ts[i]), put_tensor(paths[i], ts[i], exclusive=exclusive,
                                                                            makedirs=makedirs)))
                continue
            idx.append(i)
            keys.append(name.encode("utf-8", "surrogateescape") if name.__class__ is str else bytes(name))
            metas.append(meta)
        got = _run_tensor_batch(d, True, keys, [ts[i] for i in idx], [_nbytes(ts[i]) for i in idx], metas, flags)
        for i, r in zip(idx, got):
            results[i] = r
    return _batch_outcome(paths, results, check, "batch put_tensor")


class TensorWork:
    """A batch_put_tensor or batch_get_tensor made with async_op=True: its
    calls are in the daemon, and the caller may go on (build and send the
    next batch) while the daemon copies. wait() returns what the call
    would have returned without async_op, or raises what it would have
    raised; later wait()s (from any thread) give the same. Until wait()
    returns, the daemon may still read the tensors of a put and write
    those of a get (and a put's keys may not be there yet): leave them be.
    The work keeps the tensors alive meanwhile; one dropped without wait()
    waits for the daemon as it goes. A wait that Ctrl-C interrupts still
    waits for every call of the batch, then raises KeyboardInterrupt (the
    outcome is lost: a later wait raises RuntimeError).

    Only batches that go as one or more calls on CUDA memory (all the
    tensors on one device, plain and contiguous, their paths in one
    directory, no name twice in a put, no bytes shared by two tensors of a
    get) go to the daemon this way (submitted calls, ABI 1.7); any other
    batch is done before the call returns, and its work is already
    complete. Calls not yet waited for may run in any order: a key put by
    two of them ends with either value, and a get of a key that an
    unfinished put writes may find either version."""

    __slots__ = ("_collect", "_outcome", "_keep", "_pid", "_lock", "_raw", "_collected", "_done", "_value", "_error")

    def __init__(self, collect, outcome=None, keep=None):
        # collect waits for the batch's calls and returns their raw
        # results; outcome makes wait()'s value of them.
        self._collect, self._outcome, self._keep = collect, outcome, keep
        self._pid, self._lock = os.getpid(), threading.Lock()
        self._collected = self._done = False
        self._raw = self._value = self._error = None

    def _gather(self):
        """Collect the calls (the lock held): once this returns or raises,
        the daemon is done with the tensors."""
        if self._collected:
            return
        try:
            self._raw = self._collect()
        except Exception as e:  # kept, and raised by each wait
            self._error = e
        except BaseException:
            self._error = RuntimeError("a wait for this batch was interrupted: its outcome is lost")
            raise
        finally:
            self._collected, self._collect, self._keep = True, None, None

    def wait(self):
        """The batch's outcome, once the daemon is done with every tensor."""
        if self._pid != os.getpid():
            raise RuntimeError("a TensorWork of another process (made before a fork)")
        with self._lock:
            if not self._done:
                self._gather()
                if self._error is None:
                    try:
                        self._value = self._raw if self._outcome is None else self._outcome(self._raw)
                    except Exception as e:
                        self._error = e
                self._done, self._outcome, self._raw = True, None, None
        if self._error is not None:
            raise self._error
        return self._value

    def is_completed(self):
        """Whether the daemon is done with the batch (its calls collected)."""
        return self._collected

    def __del__(self):
        # Only the calls, not the outcome (which may make calls of its
        # own): a collection can run anywhere, even under this module's
        # locks. A work some thread is waiting for is that thread's.
        try:
            if not self._collected and self._pid == os.getpid() and self._lock.acquire(False):
                try:
                    self._gather()
                finally:
                    self._lock.release()
        except BaseException:
            pass


def _done(async_op, fn):
    """fn(), or with async_op a TensorWork that holds its outcome (fn's
    value, or what it raised, for wait() to raise)."""
    if not async_op:
        return fn()
    work = TensorWork(fn)
    try:
        work.wait()
    except Exception:
        pass  # kept for the caller's wait()
    return work


def _raiser(e):
    """A function that raises e (a submit's error, for wait() to raise)."""
    def fail():
        raise e
    return fail


def _barrier(d):
    """Wait until every call submitted on d's fd so far is over (results
    left for their waiters): the daemon is then done with their memory."""
    try:
        d.wait_calls()
    except OSError:
        pass


def _submit_tensor_batch(d, put, names, ts, sizes, metas, flags, ptrs, devs):
    """Submit (ABI 1.7) the calls of a batch of CUDA tensors, all on one
    device and none empty, as _run_tensor_batch would send them (flags: a
    put's; a get's are FLAG_WHOLE); returns a function that waits for
    them and returns [(result, version)] in order, or None when the batch
    cannot go this way (TensorWork says which can). A call naming more
    allocations than one call carries, or one the directory's fd has no
    room for (EBUSY), is made at once instead. If submitting fails, the
    calls already submitted are waited for before the error is raised."""
    from . import cudadrv

    count = len(names)
    dev = devs[0] if devs else -1
    if not count or getattr(d, "abi", (1, 3)) < (1, 7) or dev < 0 or min(devs) != max(devs) or \
            min(sizes) <= 0 or (len(set(names)) != count if put else spans_overlap(ptrs, sizes)):
        return None
    _torch().cuda.current_stream(dev).synchronize()
    flags = flags if put else _abi.FLAG_WHOLE
    per, room, max_refs = _abi.MAX_BATCH, _abi.VBATCH_AREA_BYTES, _abi.MAX_GPU_REFS
    calls = []  # (first key, end, a call to wait for or its results)
    try:
        pos = 0
        # One call, the common case, takes no loop over its keys.
        whole = count <= per and 24 * count + sum(map(len, names)) + sum(map(len, metas)) <= room
        while pos < count:
            end, used = (count, 0) if whole else (pos, 0)
            while end < count and end - pos < per:
                used += 24 + len(names[end]) + len(metas[end])
                if used > room:
                    break
                end += 1
            if end == pos:
                raise ValueError(f"{names[pos]!r}: too large for one batch")
            refs, idx, offs = cudadrv.handles.locate_columns(ptrs[pos:end], sizes[pos:end], dev)
            if len(refs) > max_refs:
                calls.append((pos, end, _run_tensor_batch(d, put, names[pos:end], ts[pos:end], sizes[pos:end],
                                                          metas[pos:end], flags if put else None, ptrs[pos:end],
                                                          devs[pos:end], in_part=True)))
                pos = end
                continue
            args = _gpu_columns(put, names[pos:end], sizes[pos:end], metas[pos:end], flags, refs, idx, offs)
            try:
                calls.append((pos, end, d.submit_columns(*args)))
            except OSError as e:
                if e.errno != errno.EBUSY:
                    raise
                calls.append((pos, end, d.send_columns(*args, versions=True)))
            pos = end
    except BaseException:
        for _, _, c in calls:
            if c.__class__ is not list:
                try:
                    d.wait_columns(c)
                except OSError:
                    pass
        _barrier(d)  # and one submitted as an interrupt came, before it was kept
        raise

    def finish():
        out = [None] * count
        stop = None  # a Ctrl-C while waiting: raised once every call is collected
        for a, b, c in calls:
            if c.__class__ is list:
                out[a:b] = c
                continue
            while True:
                try:
                    out[a:b] = d.wait_columns(c)
                except OSError as e:  # the call's results are lost with it; its work may not be
                    out[a:b] = [(-(e.errno or errno.EIO), 0)] * (b - a)
                    _barrier(d)
                except BaseException as e:
                    stop = stop or e
                    continue  # the same call again (EINVAL once it was collected)
                break
        if stop is not None:
            raise stop
        return out

    return finish


def _alone(fn):
    """(result, version) of a key that goes by itself: fn's, or -errno."""
    try:
        return fn()
    except OSError as e:
        return (-(e.errno or errno.EIO), 0)


_first, _second = operator.itemgetter(0), operator.itemgetter(1)


def _batch_outcome(paths, results, check, what):
    counts = list(map(_first, results))
    if check and counts and min(counts) < 0:
        raise BatchError(dict(zip(paths, counts)), what)
    return list(map(_second, results)) if check else counts


def batch_get_tensor(paths, out=None, device=None, *, check=True, async_op=False):
    """Read many tensors stored by put_tensor. With out (a list of
    contiguous tensors, one per path, of the stored dtypes and shapes),
    one call per 64 keys of one directory fills them, each refused alone
    (EBADMSG) unless its meta matches; returns out. Without out, each key
    is looked up first (one call each), then new tensors on device are
    filled in one call. With check=False, the list holds a negative errno
    for each key that failed; with check, BatchError if any did. With
    async_op, returns a TensorWork at once, whose wait() returns (or
    raises) that (see TensorWork; a get without out is done at once)."""
    if not async_op:
        return _batch_get(paths, out, device, check)
    paths = list(paths)
    if out is not None:
        out = list(out)
        if len(out) != len(paths):
            raise ValueError(f"{len(paths)} paths for {len(out)} out tensors")
        fast = _fast_batch(paths, out, False) if paths else None
        if fast is not None:
            d, keys, metas, sizes, ptrs, devs = fast
            try:
                finish = _submit_tensor_batch(d, False, keys, out, sizes, metas, None, ptrs, devs)
            except Exception as e:
                return _done(True, _raiser(e))
            if finish is not None:
                return TensorWork(finish, lambda got: _got_all(paths, out, sizes, got, check), out)
    return _done(True, lambda: _batch_get(paths, out, device, check))


def _got_all(paths, out, sizes, got, check):
    """batch_get_tensor's outcome of a fast batch into out, of sizes bytes,
    whose calls returned got."""
    if list(map(_first, got)) == sizes:
        return out if check else list(out)  # every tensor filled whole: nothing to look at
    results = [_got_tensor(p, o, n, r) for p, o, n, r in zip(paths, out, sizes, got)]
    return _get_outcome(paths, out, results, check)


def _batch_get(paths, out, device, check):
    """batch_get_tensor, made at once."""
    import ctypes

    paths = list(paths)
    torch = _torch()
    results = [None] * len(paths)
    if out is None:
        out = [None] * len(paths)
        for i, p in enumerate(paths):
            d, name = _dir_of(p)
            try:
                info = d.lookup(name) if d is not None else None
                if info is None or not info.meta:
                    out[i] = get_tensor(p, device=device)  # an older client's xattrs: read it now
                    results[i] = (_nbytes(out[i]), 0)
                    continue
                dname, shape = parse_meta(info.meta)
                out[i] = _empty(shape, torch_dtype(dname), device)
            except OSError as e:
                results[i] = (-(e.errno or errno.EIO), 0)
            except TensorFormatError:
                results[i] = (-errno.EBADMSG, 0)
    else:
        out = list(out)
        if len(out) != len(paths):
            raise ValueError(f"{len(paths)} paths for {len(out)} out tensors")
        fast = _fast_batch(paths, out, False) if paths else None
        if fast is not None and getattr(fast[0], "abi", (1, 3)) >= (1, 6):
            d, keys, metas, sizes, ptrs, devs = fast
            return _got_all(paths, out, sizes, _run_tensor_batch(d, False, keys, out, sizes, metas, None, ptrs, devs),
                            check)
        for o in out:
            _check_target(o)
    todo = [i for i in range(len(paths)) if results[i] is None]
    # An object longer than its meta says fails instead of being cut
    # short: the daemon says so (FLAG_WHOLE, ABI 1.6), or, from an older
    # one, the byte past each tensor fills its probe.
    probe = (ctypes.c_ubyte * max(len(paths), 1))()
    for d, members in _batch_groups([paths[i] for i in todo]):
        members = [(todo[j], name) for j, name in members]
        if d is None:
            for i, _ in members:
                results[i] = _alone(lambda i=i: (_nbytes(get_tensor(paths[i], out=out[i])), 0))
            continue
        whole = getattr(d, "abi", (1, 3)) >= (1, 6)
        idx, keys, metas = [], [], []
        for i, name in members:
            meta = format_meta(out[i].dtype, out[i].shape)
            if len(meta) > _abi.MAX_META:
                results[i] = _alone(lambda i=i: (_nbytes(get_tensor(paths[i], out=out[i])), 0))
                continue
            idx.append(i)
            keys.append(name.encode("utf-8", "surrogateescape") if name.__class__ is str else bytes(name))
            metas.append(meta)
        sizes = [_nbytes(out[i]) for i in idx]
        extra = None if whole else [ctypes.addressof(probe) + i for i in idx]
        got = _run_tensor_batch(d, False, keys, [out[i] for i in idx], sizes, metas, extra)
        for i, n, r in zip(idx, sizes, got):
            results[i] = _got_tensor(paths[i], out[i], n, r)
    return _get_outcome(paths, out, results, check)


def _got_tensor(path, out, n, r):
    """The (result, version) of a batch get of n bytes into out: -EIO for
    an object longer or shorter than its meta says, and an older client's
    tensor (xattrs, no meta) read on its own."""
    if r[0] == n + 1 or r[0] == -errno.EOVERFLOW:
        return (-errno.EIO, 0)  # longer than its meta says
    if 0 <= r[0] < n:
        return (-errno.EIO, 0)  # shorter
    if r[0] == -errno.EBADMSG and _legacy(path):
        # An older client's xattrs (else a tensor that does not fit).
        return _alone(lambda: (_nbytes(get_tensor(path, out=out)), 0))
    return r


def _get_outcome(paths, out, results, check):
    if check and any(r[0] < 0 for r in results):
        raise BatchError({p: r[0] for p, r in zip(paths, results)}, "batch get_tensor")
    return out if check else [o if r[0] >= 0 else r[0] for o, r in zip(out, results)]


def _legacy(path):
    """Whether path carries the dtype/shape xattrs and no meta."""
    try:
        os.getxattr(path, META_XATTR)
        return False
    except OSError:
        pass
    try:
        os.getxattr(path, DTYPE_XATTR)
        return True
    except OSError:
        return False


def get_tensor_range(path, out, offset=0):
    """Read out.nbytes bytes of the object at byte offset into the
    contiguous tensor out (CPU or CUDA), whatever its dtype and shape;
    return the bytes read (fewer at the end of the object; OSError ERANGE
    beyond it). E.g. rows a..b of a stored (n, m) float32 matrix:
    out = torch.empty(b - a, m); get_tensor_range(p, out, a * m * 4)."""
    _check_target(out)
    if offset < 0:
        raise ValueError("negative offset")
    with File(path) as f:
        return _get(f, out, _nbytes(out), offset)


def register_tensor(file, tensor):
    """Register a contiguous CUDA tensor's memory on an open File
    (REGISTER_BUFFER, MC_KIND_CUDA); return (buffer id, nbytes). Then
    file.put_buf(id, buf_off, n) / file.get_buf(id, buf_off, n, offset) move
    bytes at buf_off of the tensor without looking anything up; the caller
    synchronizes the streams that use the tensor, and keeps it alive until
    file.unregister(id) or file.close()."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor) or _device_kind(tensor) != "cuda":
        raise ValueError("register_tensor: want a CUDA tensor (host memory: File.register of a memfd)")
    _check_target(tensor)
    nbytes = _nbytes(tensor)
    if nbytes == 0:
        raise ValueError("register_tensor: empty tensor")
    with _OnDevice(tensor, nbytes) as loc:
        return _cuda_errors(file, loc, lambda: file.register_gpu(loc, nbytes)), nbytes


def save_state_dict(dir, state_dict, *, exclusive=False, prune=False):
    """Store every tensor of state_dict under directory dir (created if
    needed), one key per entry, named by escape_key ("layer.0.weight"
    stays, "/" becomes "%2F"); return {name: version}. Values must be
    tensors (TypeError otherwise, before anything is written). prune:
    afterwards remove the other files in dir that carry tensor attributes
    (entries of an earlier save), so that dir holds exactly state_dict."""
    torch = _torch()
    dir = os.fspath(dir)
    items = []
    names = set()
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state dict entry {name!r}: {type(value).__name__}, want a tensor")
        fname = escape_key(name)
        if fname in names:  # pragma: no cover - escape_key is injective
            raise ValueError(f"state dict entry {name!r}: duplicate file name")
        names.add(fname)
        items.append((name, fname, value))
    os.makedirs(dir, exist_ok=True)
    versions = {}
    for name, fname, value in items:
        versions[name] = put_tensor(os.path.join(dir, fname), value, exclusive=exclusive, makedirs=False)
    if prune:
        for e in os.scandir(dir):
            if e.name in names or not e.is_file(follow_symlinks=False):
                continue
            if not _has_tensor_attrs(e.path):
                continue
            os.unlink(e.path)
    return versions


def _has_tensor_attrs(path):
    for attr in (META_XATTR, DTYPE_XATTR):
        try:
            os.getxattr(path, attr)
            return True
        except OSError:
            pass
    return False


def state_dict_keys(dir):
    """{name: file name} of the entries of a directory written by
    save_state_dict, sorted by name; ValueError for a regular file whose
    name escape_key cannot have made."""
    dir = os.fspath(dir)
    out = {}
    for e in os.scandir(dir):
        if e.is_file(follow_symlinks=False):
            out[unescape_key(e.name)] = e.name
    return dict(sorted(out.items()))


def load_state_dict(dir, device=None):
    """{name: tensor} of every entry of dir (see save_state_dict), sorted
    by name, each read with get_tensor onto device (None: torch's default
    device). Subdirectories are skipped; a file without tensor attributes
    raises TensorFormatError."""
    dir = os.fspath(dir)
    return {name: get_tensor(os.path.join(dir, fname), device=device) for name, fname in state_dict_keys(dir).items()}


__all__ = [
    "DTYPE_XATTR", "SHAPE_XATTR", "META_XATTR", "TensorFormatError",
    "put_tensor", "get_tensor", "batch_put_tensor", "batch_get_tensor", "format_meta", "parse_meta", "get_tensor_range", "tensor_info", "register_tensor",
    "save_state_dict", "load_state_dict", "state_dict_keys",
    "dtype_name", "torch_dtype", "format_shape", "parse_shape", "parse_dtype", "escape_key", "unescape_key",
    "xattrs_for", "expected_nbytes", "mismatch",
]
