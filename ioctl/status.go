package ioctl

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// StatusXattr is the attribute of a mount's root that holds the daemon's
// status, as JSON (what `mooncake-fs status --json` prints).
const StatusXattr = "user.mooncake.status"

// ReadStatus returns the status JSON of the daemon serving the mount at
// dir (its root), however long it is.
func ReadStatus(dir string) ([]byte, error) {
	buf := make([]byte, 64<<10)
	for {
		n, err := unix.Getxattr(dir, StatusXattr, buf)
		if errors.Is(err, unix.ERANGE) && len(buf) < 64<<20 {
			buf = make([]byte, 2*len(buf)) // it grew since
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("ioctl: status of %s: %w", dir, err)
		}
		return buf[:n], nil
	}
}
