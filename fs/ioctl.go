package fs

import (
	"context"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"

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

// ioctlHook, when set (tests), runs in every data-path ioctl once it is
// counted, before the command.
var ioctlHook func(cmd uint32)
