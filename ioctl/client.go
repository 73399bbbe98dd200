package ioctl

import (
	"errors"
	"fmt"
	"os"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrNotMooncake is returned by Probe for files of other file systems.
var ErrNotMooncake = errors.New("ioctl: not a mooncake-fs file")

// call issues cmd on f with arg as the in/out buffer.
func call(f *os.File, cmd uint32, arg []byte) error {
	if uint32(len(arg)) != Size(cmd) {
		return fmt.Errorf("ioctl %#x: buffer %d B, command wants %d: %w", cmd, len(arg), Size(cmd), ErrArgSize)
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return err
	}
	var errno unix.Errno
	cerr := rc.Control(func(fd uintptr) {
		_, _, errno = unix.Syscall(unix.SYS_IOCTL, fd, uintptr(cmd), uintptr(unsafe.Pointer(&arg[0])))
	})
	if cerr != nil {
		return cerr
	}
	if errno != 0 {
		return errno
	}
	return nil
}

// Probe checks that f is on mooncake-fs and returns the daemon's ABI
// version.
func Probe(f *os.File) (ABIVersionArg, error) {
	b := MagicArg{}.Marshal()
	if err := call(f, CmdGetMagic, b); err != nil {
		if errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) {
			return ABIVersionArg{}, fmt.Errorf("%s: %w", f.Name(), ErrNotMooncake)
		}
		return ABIVersionArg{}, err
	}
	var m MagicArg
	if err := m.Unmarshal(b); err != nil || m.Magic != MagicValue {
		return ABIVersionArg{}, fmt.Errorf("%s: magic %#x: %w", f.Name(), m.Magic, ErrNotMooncake)
	}
	v := ABIVersionArg{}.Marshal()
	if err := call(f, CmdGetABIVersion, v); err != nil {
		return ABIVersionArg{}, err
	}
	var a ABIVersionArg
	if err := a.Unmarshal(v); err != nil {
		return ABIVersionArg{}, err
	}
	return a, nil
}
