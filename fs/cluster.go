package fs

import (
	"context"
	"strings"

	gofs "github.com/hanwen/go-fuse/v2/fs"
)

// Cluster mode (Options.Cluster): other daemons change the namespace
// behind this kernel's back. Two things keep it honest:
//
//   - close-to-open: LOOKUP, GETATTR, OPEN and READDIR first Sync the
//     store's index, so a file closed on another node is seen whole as
//     soon as that close returned; attributes and negative entries are not
//     cached by the kernel (timeouts 0);
//   - invalidation: every change the index watch reports drops the
//     kernel's dentry and cached attributes and pages of that key, so
//     cached positive entries and mmap'd pages do not outlive a change.

// syncIndex is the close-to-open step; a failure (the cluster index is
// unreachable) leaves reads answering from the cached view.
func (f *FS) syncIndex(ctx context.Context) {
	if !f.opts.Cluster {
		return
	}
	if err := f.st.Sync(ctx); err != nil {
		f.log.WithError(err).Debug("index sync failed; answering from the cached view")
	}
}

// followIndex invalidates the kernel's caches of keys that change, until
// ctx ends.
func (f *FS) followIndex(ctx context.Context, root *gofs.Inode) error {
	ch, err := f.st.Index().Watch(ctx, "")
	if err != nil {
		return err
	}
	go func() {
		for ev := range ch {
			invalidatePath(root, ev.Object.Key)
		}
	}()
	return nil
}

// invalidatePath drops what the kernel caches about key below root: the
// dentry of its last component and, when the kernel knows the inode, its
// attributes and pages.
func invalidatePath(root *gofs.Inode, key string) {
	parent := root
	parts := strings.Split(key, "/")
	for i, name := range parts {
		ch := parent.GetChild(name)
		if i == len(parts)-1 {
			if ch != nil {
				ch.NotifyContent(0, 0)
			}
			parent.NotifyEntry(name)
			return
		}
		if ch == nil {
			return // nothing below is cached
		}
		parent = ch
	}
}

// detached keeps a request's values (the caller's credentials) but not its
// cancellation: a change, once started, runs to its end. The kernel
// interrupts a request when its caller gets any signal (Go programs get
// them all the time), and a commit cut off midway -- an etcd transaction
// whose outcome is unknown -- must not be reported as EINTR.
func detached(ctx context.Context) context.Context { return context.WithoutCancel(ctx) }
