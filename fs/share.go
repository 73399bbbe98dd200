package fs

import (
	"fmt"
	"sync"
	"syscall"
)

// userCounts counts things the mount holds for its callers, all together
// and by user, within bounds: at most total in all, and at most perUser
// for any one user but root, so that one user cannot take every one and
// leave the others EBUSY. With rootFree, root's are not counted at all.
type userCounts struct {
	what           string // what is counted, for errors
	total, perUser int    // the bounds
	rootFree       bool
	full           error // what take's error wraps; nil: EBUSY
	mu             sync.Mutex
	held           int
	byUser         map[uint32]int
}

// take counts one more of uid's, or fails (full, else EBUSY) when the
// mount, or uid's share of it, holds as many as it may.
func (c *userCounts) take(uid uint32) error {
	if uid == 0 && c.rootFree {
		return nil
	}
	full := c.full
	if full == nil {
		full = syscall.EBUSY
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.held >= c.total {
		return fmt.Errorf("the mount holds %d %s: %w", c.held, c.what, full)
	}
	if uid != 0 && c.byUser[uid] >= c.perUser {
		return fmt.Errorf("user %d holds %d %s: %w", uid, c.byUser[uid], c.what, full)
	}
	if c.byUser == nil {
		c.byUser = map[uint32]int{}
	}
	c.held++
	c.byUser[uid]++
	return nil
}

// put uncounts one of uid's that take counted.
func (c *userCounts) put(uid uint32) {
	if uid == 0 && c.rootFree {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.held--
	if c.byUser[uid]--; c.byUser[uid] <= 0 {
		delete(c.byUser, uid)
	}
}

// count returns how many the mount holds.
func (c *userCounts) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.held
}

// maxIoctlsTotal and maxIoctlsPerUser bound the data-path ioctls of users
// other than root running at once. A call whose copy waits on the
// caller's memory (a mapping of a file system that does not answer, a
// userfaultfd range) holds a thread of the daemon until that memory
// answers, and the Go runtime ends the process past 10000 threads: so a
// user may have maxIoctlsPerUser such calls, and all users together
// maxIoctlsTotal; beyond, EBUSY.
const (
	maxIoctlsTotal   = 4096
	maxIoctlsPerUser = 256
)

// The open files and directories of the mount (Options.MaxOpen, all users
// together) are counted by user too: a user other than root may hold a
// quarter of them, so that one user's descriptors cannot leave every
// other user ENFILE.
const openSharePerUser = 4
