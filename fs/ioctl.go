package fs

import (
	"context"
	"encoding/binary"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
)

// Ioctl implements gofs.NodeIoctler: the ABI of package ioctl. Unknown
// commands answer ENOTTY, malformed arguments EINVAL; neither changes
// anything.
func (n *node) Ioctl(ctx context.Context, fh gofs.FileHandle, cmd uint32, arg uint64, input []byte, output []byte) (result int32, errno syscall.Errno) {
	ctx = detached(ctx)
	start := time.Now()
	var err error
	key, _ := n.key()
	n.fs.ioctls.running.Add(1)
	defer func() {
		n.fs.ioctls.lastEnd.Store(time.Now().UnixNano())
		n.fs.ioctls.running.Add(-1)
		n.fs.opDone(ctx, "ioctl", key, 0, start, errno, err)
	}()
	switch cmd {
	case unix.FS_IOC_GETFLAGS, fsIOC32GetFlags:
		// lsattr, and the kernel's file attributes: none is set.
		if len(output) < 4 {
			return 0, syscall.EINVAL
		}
		clear(output[:4])
		return 0, 0
	case unix.FS_IOC_SETFLAGS, fsIOC32SetFlags:
		// chattr: clearing every flag is what there is to do; no flag
		// (immutable, append only, no dump, ...) is kept.
		if len(input) < 4 {
			return 0, syscall.EINVAL
		}
		if binary.NativeEndian.Uint32(input) != 0 {
			return 0, syscall.EOPNOTSUPP
		}
		return 0, 0
	case fsIOCFSGetXattr:
		// The same as extended flags (struct fsxattr), which the kernel
		// reads before it sets flags: all zero.
		if len(output) < sizeFsxattr {
			return 0, syscall.EINVAL
		}
		clear(output[:sizeFsxattr])
		return 0, 0
	case fsIOCFSSetXattr:
		if len(input) < sizeFsxattr {
			return 0, syscall.EINVAL
		}
		for _, b := range input[:20] { // xflags, extsize, nextents, projid, cowextsize
			if b != 0 {
				return 0, syscall.EOPNOTSUPP
			}
		}
		return 0, 0
	}
	if ioctl.TypeOf(cmd) != ioctl.Type {
		return 0, syscall.ENOTTY
	}
	switch cmd {
	case ioctl.CmdGetMagic:
		if len(output) < ioctl.SizeMagicArg {
			return 0, syscall.EINVAL
		}
		copy(output, ioctl.MagicArg{Magic: ioctl.MagicValue}.Marshal())
		return 0, 0
	case ioctl.CmdGetABIVersion:
		if len(output) < ioctl.SizeABIVersionArg {
			return 0, syscall.EINVAL
		}
		copy(output, ioctl.ABIVersionArg{Major: ioctl.ABIMajor, Minor: ioctl.ABIMinor}.Marshal())
		return 0, 0
	case ioctl.CmdRegisterBuffer, ioctl.CmdUnregisterBuffer, ioctl.CmdPutBuf, ioctl.CmdGetBuf,
		ioctl.CmdPutVM, ioctl.CmdGetVM, ioctl.CmdStat, ioctl.CmdBatchPut, ioctl.CmdBatchGet,
		ioctl.CmdPutCUDA, ioctl.CmdGetCUDA, ioctl.CmdPutKey, ioctl.CmdGetKey, ioctl.CmdBatchPutV, ioctl.CmdBatchGetV,
		ioctl.CmdBatchWait, ioctl.CmdBatchPutTable, ioctl.CmdBatchGetTable, ioctl.CmdPutKeyInline, ioctl.CmdGetKeyInline:
		// The kernel passes an input buffer for _IOW commands and an output
		// buffer for _IOR ones, each of the size the command encodes.
		size := int(ioctl.Size(cmd))
		if ioctl.Dir(cmd)&1 != 0 && len(input) < size || ioctl.Dir(cmd)&2 != 0 && len(output) < size {
			return 0, syscall.EINVAL
		}
		uid, _ := caller(ctx) // root's without a caller: the daemon's own
		if err = n.fs.ioctls.byUser.take(uid); err != nil {
			return 0, toErrno(err)
		}
		defer n.fs.ioctls.byUser.put(uid)
		if hook := ioctlHook; hook != nil {
			hook(cmd)
		}
		var res int32
		res, err = n.ioctlData(ctx, fh, cmd, input, output)
		return res, toErrno(err)
	}
	return 0, syscall.ENOTTY
}

// The 32-bit forms of FS_IOC_GETFLAGS and FS_IOC_SETFLAGS (an int, not a
// long: what the kernel itself sends a FUSE server for its file
// attributes).
const (
	fsIOC32GetFlags = 0x80046601
	fsIOC32SetFlags = 0x40046602
	// FS_IOC_FSGETXATTR and FS_IOC_FSSETXATTR, of a struct fsxattr.
	fsIOCFSGetXattr = 0x801c581f
	fsIOCFSSetXattr = 0x401c5820
	sizeFsxattr     = 28
)

// ioctlHook, when set (tests), runs in every data-path ioctl once it is
// counted, before the command.
var ioctlHook func(cmd uint32)
