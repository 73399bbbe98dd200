package fs

import (
	"context"
	"errors"
	"fmt"
	"syscall"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// Permission bits, as in access(2).
const (
	mayRead  = 4
	mayWrite = 2
	mayExec  = 1
)

// allowed applies the mode bits of o to the caller, as the kernel's
// default_permissions does for file operations. Batch ioctls reach keys
// the kernel never looked up, so the daemon checks them itself.
func allowed(p *callerProc, o *store.Object, want uint32) bool {
	if p.uid == 0 {
		// Root may do anything but execute a file without any x bit.
		return want&mayExec == 0 || o.Kind == store.KindDir || o.Mode&0o111 != 0
	}
	var bits uint32
	switch {
	case p.uid == o.Uid:
		bits = o.Mode >> 6
	case p.inGroup(o.Gid):
		bits = o.Mode >> 3
	default:
		bits = o.Mode
	}
	return bits&want == want
}

// checkPath verifies that the caller may search every directory from dir
// (the directory the batch was issued on, included) down to key's parent,
// and returns that parent.
func (f *FS) checkPath(ctx context.Context, p *callerProc, dir, key string) (*store.Object, error) {
	cur := dir
	for {
		o, err := f.st.Stat(ctx, cur)
		if err != nil {
			return nil, err
		}
		if o.Kind != store.KindDir {
			return nil, fmt.Errorf("%q: %w", cur, store.ErrNotDir)
		}
		if !allowed(p, o, mayExec) {
			return nil, fmt.Errorf("search %q: %w", cur, syscall.EACCES)
		}
		parent := store.Parent(key)
		if cur == parent {
			return o, nil
		}
		rest := parent[len(cur):]
		if cur != "" {
			rest = rest[1:]
		}
		next, _, _ := cutFirst(rest)
		cur = store.Join(cur, next)
	}
}

// maxParentTries bounds how often a FlagParents put makes its key's
// directories again after another client removed them.
const maxParentTries = 8

// makeParents makes the missing directories between dir and key's parent
// (FlagParents), as mkdir -p does: mode 0755, owned by uid and gid, each
// where the caller may write and search. One made meanwhile by someone
// else is fine; a file in the way is ENOTDIR.
func (f *FS) makeParents(ctx context.Context, p *callerProc, uid, gid uint32, dir, key string) error {
	parent := store.Parent(key)
	cur := dir
	for cur != parent {
		rest := parent[len(cur):]
		if cur != "" {
			rest = rest[1:]
		}
		next, _, _ := cutFirst(rest)
		child := store.Join(cur, next)
		o, err := f.st.Stat(ctx, child)
		switch {
		case errors.Is(err, store.ErrNotFound):
			po, err := f.st.Stat(ctx, cur)
			if err != nil {
				return err
			}
			if po.Kind != store.KindDir {
				return fmt.Errorf("%q: %w", cur, store.ErrNotDir)
			}
			if !allowed(p, po, mayWrite|mayExec) {
				return fmt.Errorf("make %q: %w", child, syscall.EACCES)
			}
			if _, err := f.st.Mkdir(ctx, child, &store.Object{Mode: 0o755, Uid: uid, Gid: gid}); err != nil && !errors.Is(err, store.ErrExists) {
				return err
			}
		case err != nil:
			return err
		case o.Kind != store.KindDir:
			return fmt.Errorf("%q: %w", child, store.ErrNotDir)
		}
		cur = child
	}
	return nil
}

func cutFirst(s string) (string, string, bool) {
	for i := 0; i < len(s); i++ {
		if s[i] == '/' {
			return s[:i], s[i+1:], true
		}
	}
	return s, "", false
}
