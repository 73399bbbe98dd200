"""PyTorch tensors in mooncake-fs: one copy each way, for CPU and GPU memory.

    from mooncake_fs import tensor as mt
    mt.put_tensor("/mnt/mooncake/w", t)                # CPU: PUT_VM, CUDA: PUT_CUDA
    t2 = mt.get_tensor("/mnt/mooncake/w", device="cuda:0")
    mt.get_tensor("/mnt/mooncake/w", out=t2)           # into an existing tensor
    mt.get_tensor_range("/mnt/mooncake/w", out=row, offset=4096)
    mt.save_state_dict("/mnt/mooncake/ckpt", model.state_dict())
    sd = mt.load_state_dict("/mnt/mooncake/ckpt", device="cuda")

The object holds the tensor's bytes in C order; its dtype and shape are
extended attributes of the key, ``user.mooncake.dtype`` ("float32",
"bfloat16", ...) and ``user.mooncake.shape`` ("2,3,4"; "" for a 0-d
tensor), set after the put (``getfattr -d`` shows them). CUDA tensors move
with PUT_CUDA/GET_CUDA: the daemon opens a CUDA IPC handle of the caching
allocator's block that holds the tensor and copies between it and the
store on its own stream (see ``mooncake_fs.cudadrv``). Before each CUDA
ioctl the tensor's current stream is synchronized, so kernels queued on it
that write (put) or still use (get) the tensor are done; work on other
streams is the caller's to finish. After a get returns, the data is in
place.

torch is imported on first use; the rest of the package does not need it.
The functions without "tensor" in their name (dtype_name, format_shape,
parse_shape, escape_key, unescape_key, ...) need neither torch nor a mount.
"""

import errno
import operator
import os
import re

from .client import File

DTYPE_XATTR = "user.mooncake.dtype"
SHAPE_XATTR = "user.mooncake.shape"

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


def _nbytes(t):
    return t.numel() * t.element_size()


def _device_kind(t):
    kind = t.device.type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"tensor on {t.device}: only CPU and CUDA tensors are supported")
    return kind


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
    if hasattr(out, "is_conj") and (out.is_conj() or out.is_neg()):
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


def put_tensor(path, tensor, *, exclusive=False, makedirs=True):
    """Store a CPU or CUDA tensor at path (a key on a mount), replacing the
    object atomically; return the version that has the bytes and both
    attributes (each setxattr makes a version after the put's).

    The bytes go in one copy: PUT_VM from CPU memory, PUT_CUDA from GPU
    memory (the tensor's current stream is synchronized first). A
    non-contiguous tensor (a transpose, a strided slice, an expanded view)
    is first copied to a contiguous one on its device - that copy costs
    time and memory; pass .contiguous() tensors to avoid it. dtype and
    shape are then set as the xattrs user.mooncake.dtype/.shape: a reader
    racing a put of the same key can see the new bytes with the old
    attributes (get_tensor then fails on the size check, or reads a
    same-size tensor). exclusive: FileExistsError if the key exists with
    content. makedirs: create missing parent directories."""
    t = _source(tensor)
    nbytes = _nbytes(t)
    attrs = xattrs_for(t.dtype, tuple(t.shape))
    with _open_for_put(path, makedirs) as f:
        moved, _ = _put(f, t, nbytes, exclusive)
        if moved != nbytes:
            raise OSError(errno.EIO, f"short put: {moved} of {nbytes} bytes", f.name)
        _set_xattrs(f, attrs)
        return f.stat().version


def tensor_info(path):
    """(dtype name, shape) of a tensor stored at path, from its xattrs."""
    return _info(os.fspath(path))


def _info(target, name=None):
    """(dtype name, shape) from the xattrs of target (a path or an fd)."""
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
    torch.device, ...). With out, it must be a contiguous tensor of that
    dtype and shape (on device, if given); it is filled and returned. The
    data moves in one copy (GET_VM or GET_CUDA) and is in place on return.
    TensorFormatError when the attributes are missing or do not match the
    object's size."""
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
            _check_target(out)
            if device is not None and not _same_device(device, out.device):
                raise ValueError(f"out is on {out.device}, device={device!r} asked")
            why = mismatch(dname, shape, out.dtype, tuple(out.shape), out.is_contiguous(), _nbytes(out), want)
            if why:
                raise ValueError(f"{f.name}: out does not fit: {why}")
        got = _get(f, out, want, 0)
        if got != want:
            raise OSError(errno.EIO, f"short get: {got} of {want} bytes", f.name)
    return out


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
        return _cuda_errors(file, loc, lambda: file.register_cuda(loc.handle, nbytes, loc.dev_off)), nbytes


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
            try:
                os.getxattr(e.path, DTYPE_XATTR)
            except OSError:
                continue
            os.unlink(e.path)
    return versions


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
    "DTYPE_XATTR", "SHAPE_XATTR", "TensorFormatError",
    "put_tensor", "get_tensor", "get_tensor_range", "tensor_info", "register_tensor",
    "save_state_dict", "load_state_dict", "state_dict_keys",
    "dtype_name", "torch_dtype", "format_shape", "parse_shape", "parse_dtype", "escape_key", "unescape_key",
    "xattrs_for", "expected_nbytes", "mismatch",
]
