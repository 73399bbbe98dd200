package fs

import (
	"context"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// Cluster mode (Options.Cluster): other daemons change the namespace
// behind this kernel's back. Three things keep it honest:
//
//   - the store does not let a commit return before every live node's
//     index cache has it (store.Options.Cluster), so lookups, getattr and
//     readdir here answer from the cache, without asking etcd, and still
//     see a file closed on another node whole once that close returned;
//   - the kernel caches no attributes or negative entries (timeouts 0);
//   - every change the index watch reports drops the kernel's dentry and
//     cached attributes and pages of that key, so cached positive entries
//     and mmap'd pages do not outlive a change.

// followIndex invalidates the kernel's caches of keys that change, until
// ctx ends.
func (f *FS) followIndex(ctx context.Context, root *gofs.Inode) error {
	ch, err := f.st.Index().Watch(ctx, "")
	if err != nil {
		return err
	}
	go func() {
		for ev := range ch {
			if !store.IsInternal(ev.Object.Key) {
				invalidatePath(root, ev.Object.Key)
			}
		}
	}()
	return nil
}

// invalidatePath drops what the kernel caches about key below root: the
// dentry of its last component and, when the kernel knows the inode, its
// attributes and pages.
func invalidatePath(root *gofs.Inode, key string) {
	parent, name, ch, last := walkKnown(root, key)
	if !last {
		return // nothing below is cached
	}
	if ch != nil {
		ch.NotifyContent(0, 0)
	}
	parent.NotifyEntry(name)
}

// detached keeps a request's values (the caller's credentials) but not its
// cancellation: a change, once started, runs to its end. The kernel
// interrupts a request when its caller gets any signal (Go programs get
// them all the time), and a commit cut off midway -- an etcd transaction
// whose outcome is unknown -- must not be reported as EINTR. The caller
// is kept on top, where a lookup of it (several a call) finds it without
// the allocation that each lookup through context.WithoutCancel makes.
func detached(ctx context.Context) context.Context {
	d := context.WithoutCancel(ctx)
	if c, ok := fuse.FromContext(ctx); ok {
		return fuse.NewContext(d, c)
	}
	return d
}
