package fs

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"

	gofs "github.com/hanwen/go-fuse/v2/fs"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// The kernel keeps a name it looked up for the entry timeout. When this
// daemon's eviction takes the file away meanwhile, the kernel still sends
// opens and getattrs for the gone inode; they answer ESTALE and the
// kernel walks the path once more, and under churn (keys evicted and put
// anew all the time) that walk could land on a file evicted in turn, and
// the caller got ESTALE; with a long --cache-timeout, stat showed the
// gone file for that long. So the kernel is told to forget the name of
// each evicted file that it knows (a node in the tree), and a later walk
// asks the daemon. The store tells of an eviction on the evicting
// goroutine, which may be serving a request the kernel sent holding the
// lock of the very directory (a create that made room), or hold the
// store's lock of metadata eviction that such a request waits for, while
// the kernel's forgetting takes that directory lock: so the notes are
// queued, and a goroutine of their own tells the kernel. Only names the
// kernel knows are queued (most evicted keys were put by name and never
// looked up). When the queue is full a note is dropped, and once the
// queue is empty again the goroutine walks the whole tree the kernel
// knows and has it forget every name whose file is gone.

// evictNote is a file eviction took: its key and inode.
type evictNote struct {
	key string
	ino uint64
}

// evictNoteQueue bounds the notes waiting for the kernel.
const evictNoteQueue = 4096

// followEvictions has the kernel forget the names of files the store
// evicts, until ctx ends. Not with a zero entry timeout: the kernel keeps
// no names then.
func (f *FS) followEvictions(ctx context.Context, root *gofs.Inode) {
	if f.opts.EntryTimeout == 0 {
		return
	}
	notes := make(chan evictNote, evictNoteQueue)
	var dropped atomic.Bool // a note did not fit: sweep once the queue is empty
	stop := f.st.OnEvict(func(key string, ino uint64) {
		n := evictNote{key, ino}
		if _, _, ok := n.known(root); !ok {
			return // the common case: no goroutine to wake
		}
		select {
		case notes <- n:
		default:
			dropped.Store(true)
		}
	})
	go func() {
		defer stop()
		for {
			select {
			case <-ctx.Done():
				return
			case n := <-notes:
				forgetEvicted(root, n)
				continue
			default:
			}
			if dropped.Swap(false) {
				f.forgetGone(ctx, root, "")
				continue
			}
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

// forgetGone has the kernel forget each name below dir (key dirKey) whose
// file is no longer the one it knows: the sweep after dropped notes.
func (f *FS) forgetGone(ctx context.Context, dir *gofs.Inode, dirKey string) {
	for name, ch := range dir.Children() {
		if ctx.Err() != nil {
			return
		}
		key := name
		if dirKey != "" {
			key = dirKey + "/" + name
		}
		if ch.IsDir() {
			f.forgetGone(ctx, ch, key)
			continue
		}
		o, err := f.st.Lookup(ctx, key)
		if errors.Is(err, store.ErrNotFound) || err == nil && o.Ino != ch.StableAttr().Ino {
			dir.NotifyEntry(name)
		}
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
