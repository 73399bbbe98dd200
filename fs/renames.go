package fs

import (
	"sync"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// renames sits in front of go-fuse's node bridge and holds FS.renaming
// (a read share) through each rename: from before node.Rename moves the
// key in the store until the bridge, after it returns, moves the inode
// in its tree. In between, node.key still says the old name, which the
// store no longer has; settledKey waits that out.
type renames struct {
	fuse.RawFileSystem
	mu *sync.RWMutex
}

// Rename implements fuse.RawFileSystem.
func (r renames) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return r.RawFileSystem.Rename(cancel, in, oldName, newName)
}

// settledKey is n.key once no rename is between the store and go-fuse's
// tree: for a writer whose commit found its file, or its call's
// directory, gone from the name it had, to learn whether a rename moved
// it (and where) or it really went.
func (n *node) settledKey() (string, bool) {
	n.fs.renaming.Lock()
	n.fs.renaming.Unlock() // (a wait for the renames in flight: nothing to guard)
	return n.key()
}
