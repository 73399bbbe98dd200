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
func (c *userCounts) take(uid uint32) error { return c.takeN(uid, 1) }

// put uncounts one of uid's that take counted.
func (c *userCounts) put(uid uint32) { c.putN(uid, 1) }

// takeN counts n more of uid's (bytes, say), as take does one: all or,
// past a bound, none.
func (c *userCounts) takeN(uid uint32, n int) error {
	if uid == 0 && c.rootFree {
		return nil
	}
	full := c.full
	if full == nil {
		full = syscall.EBUSY
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if n > c.total-c.held {
		return fmt.Errorf("the mount holds %d %s, %d more would pass %d: %w", c.held, c.what, n, c.total, full)
	}
	if uid != 0 && n > c.perUser-c.byUser[uid] {
		return fmt.Errorf("user %d holds %d %s, %d more would pass its %d: %w", uid, c.byUser[uid], c.what, n, c.perUser, full)
	}
	if c.byUser == nil {
		c.byUser = map[uint32]int{}
	}
	c.held += n
	c.byUser[uid] += n
	return nil
}

// putN uncounts n of uid's that takeN counted.
func (c *userCounts) putN(uid uint32, n int) {
	if uid == 0 && c.rootFree {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.held -= n
	if c.byUser[uid] -= n; c.byUser[uid] <= 0 {
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
// together), and its registered buffers (Options.MaxRegistrationsTotal,
// MaxRegisteredBytes), are counted by user too: a user other than root
// may hold a quarter of each, so that one user cannot leave every other
// user ENFILE or EMFILE.
const sharePerUser = 4

// sharedCounts counts what, total of it for all users together and a
// sharePerUser-th of that (at least one) for a user other than root; a
// count past either fails with full.
func sharedCounts(what string, total int, full error) userCounts {
	return userCounts{what: what, total: total, perUser: max(1, total/sharePerUser), full: full}
}
