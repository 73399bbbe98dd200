package fs

import (
	"context"
	"errors"
	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/store/etcdindex"
	"syscall"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/pinned"
	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// errnoTable maps the errors of the layers below to errno. It is walked in
// order with errors.Is, so wrapped and joined errors map like their cause.
var errnoTable = []struct {
	err   error
	errno syscall.Errno
}{
	{store.ErrNotFound, syscall.ENOENT},
	{store.ErrExists, syscall.EEXIST},
	{store.ErrNotDir, syscall.ENOTDIR},
	{store.ErrIsDir, syscall.EISDIR},
	{store.ErrNotEmpty, syscall.ENOTEMPTY},
	{store.ErrNameTooLong, syscall.ENAMETOOLONG},
	{store.ErrInvalidName, syscall.EINVAL},
	{store.ErrNoSpace, syscall.ENOSPC},
	{segment.ErrNoSpace, syscall.ENOSPC},
	{store.ErrStale, syscall.ESTALE},
	{store.ErrLost, syscall.EIO},
	{store.ErrUnavailable, syscall.ETIMEDOUT},
	{etcdindex.ErrCorrupt, syscall.EIO},
	{store.ErrInvalid, syscall.EINVAL},
	{store.ErrTooLarge, syscall.EFBIG},
	{store.ErrUnsupported, syscall.EOPNOTSUPP},
	{store.ErrConflict, syscall.EAGAIN},
	{store.ErrClosed, syscall.EBADF},
	{transfer.ErrBadRequest, syscall.EFAULT},
	{transfer.ErrFault, syscall.EFAULT},
	{transfer.ErrNoProcess, syscall.ESRCH},
	{transfer.ErrUnreachable, syscall.EHOSTUNREACH},
	// A node restarted under a write or a read of its bytes: they are
	// gone as if it had died (a file lost with them is ErrLost, above).
	{transfer.ErrStaleEpoch, syscall.EHOSTUNREACH},
	{store.ErrRange, syscall.ERANGE},
	{store.ErrRemote, syscall.EREMOTE},
	{errBufRange, syscall.EFAULT},
	{errBadID, syscall.EINVAL},
	{errNotOwner, syscall.EPERM},
	{pinned.ErrNotShmem, syscall.EINVAL},
	{errBadRegister, syscall.EINVAL},
	{errTooManyRegs, syscall.EMFILE},
	{errTooManyOpen, syscall.ENFILE},
	{errNotWritable, syscall.EBADF},
	{errNotDirFd, syscall.ENOTDIR},
	{errBadBatch, syscall.EINVAL},
	{errNoCall, syscall.EINVAL},
	{errAsyncVM, syscall.EINVAL},
	{errNoGPU, syscall.ENODEV},
	{errMetaMismatch, syscall.EBADMSG},
	{errValueTooLong, syscall.EOVERFLOW},
	{errDevRange, syscall.EFAULT},
	{cuda.ErrUnavailable, syscall.ENODEV},
	{cuda.ErrInvalid, syscall.EINVAL},
	{cuda.ErrOutOfMemory, syscall.ENOMEM},
	{ioctl.ErrShortArg, syscall.EINVAL},
	{ioctl.ErrArgSize, syscall.EINVAL},
	{ioctl.ErrFlags, syscall.EINVAL},
	{ioctl.ErrBadTable, syscall.EINVAL},
	{context.Canceled, syscall.EINTR},
	{context.DeadlineExceeded, syscall.ETIMEDOUT},
}

// toErrno maps err to an errno. Unknown errors become EIO; the caller logs
// them. It never returns ENOSYS for a real error: the kernel would take
// that as "operation not implemented" and stop asking.
func toErrno(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		if e == syscall.ENOSYS {
			return syscall.EIO
		}
		return e
	}
	for _, m := range errnoTable {
		if errors.Is(err, m.err) {
			return m.errno
		}
	}
	return syscall.EIO
}
