package fs

import (
	"context"
	"strings"

	gofs "github.com/hanwen/go-fuse/v2/fs"
)

// The kernel keeps a name it looked up for the entry timeout. When this
// daemon's eviction takes the file away meanwhile, the kernel still sends
// opens and getattrs for the gone inode; they answer ESTALE and the
// kernel walks the path once more, and under churn (keys evicted and put
// anew all the time) that walk could land on a file evicted in turn, and
// the caller got ESTALE. So the kernel is told to forget the name of each
// file evicted that it knows (a node in the tree), and a later walk asks
// the daemon. The store tells of an eviction on the evicting goroutine,
// which may be serving a request the kernel sent holding the lock of the
// very directory (a create that made room), the lock that the kernel's
// forgetting takes: so the notes are queued, and a goroutine of their own
// tells the kernel. Only names the kernel knows are queued (most evicted
// keys were put by name and never looked up), and a note that finds the
// queue full is dropped: that name lasts out its entry timeout.

// evictNote is a file eviction took: its key and inode.
type evictNote struct {
	key string
	ino uint64
}

// evictNoteQueue bounds the notes waiting for the kernel.
const evictNoteQueue = 4096

// followEvictions has the kernel forget the names of files the store
// evicts, until ctx ends.
func (f *FS) followEvictions(ctx context.Context, root *gofs.Inode) {
	notes := make(chan evictNote, evictNoteQueue)
	f.st.OnEvict(func(key string, ino uint64) {
		n := evictNote{key, ino}
		if _, _, ok := n.known(root); !ok {
			return // the common case: no goroutine to wake
		}
		select {
		case notes <- n:
		default:
		}
	})
	go func() {
		defer f.st.OnEvict(nil)
		for {
			select {
			case <-ctx.Done():
				return
			case n := <-notes:
				forgetEvicted(root, n)
			}
		}
	}()
}

// known finds n's name in the tree the kernel knows below root, if it
// names n's inode there.
func (n evictNote) known(root *gofs.Inode) (parent *gofs.Inode, name string, ok bool) {
	parent, name, ch, _ := walkKnown(root, n.key)
	return parent, name, ch != nil && ch.StableAttr().Ino == n.ino
}

// forgetEvicted has the kernel forget n's name if it still names n's
// inode (a put may have made the key anew since, and the kernel looked
// that one up).
func forgetEvicted(root *gofs.Inode, n evictNote) {
	if parent, name, ok := n.known(root); ok {
		parent.NotifyEntry(name)
	}
}

// walkKnown follows rel, a slash-separated path, down the tree the kernel
// knows from dir: it stops at the first name dir's tree does not have
// (ch nil) or at the last one (last), and returns that name, the node it
// is in and the node it names.
func walkKnown(dir *gofs.Inode, rel string) (parent *gofs.Inode, name string, ch *gofs.Inode, last bool) {
	parent = dir
	for {
		name, rest, found := strings.Cut(rel, "/")
		ch = parent.GetChild(name)
		if !found || ch == nil {
			return parent, name, ch, !found
		}
		parent, rel = ch, rest
	}
}
