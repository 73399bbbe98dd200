package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Renames of large trees.
//
// An Index may bound the swaps of one CompareAndSwap (SwapLimiter: etcd
// allows 128 operations a transaction). A directory rename takes two
// swaps a descendant; past the bound the tree moves in steps under an
// intent, a hidden object (KindIntent, at a key no file can have:
// intentKey) that names both trees. There is one intent key, so one
// stepped rename runs at a time in the whole namespace: its first step
// creates the intent (only if there is none) and moves the directory's
// own object; every further step moves up to half the bound of entries
// and rewrites the intent, comparing it; the last deletes it. Each step is atomic, so every file
// is at exactly one of its two names at every moment; another process
// sees the files arrive in steps. A rename that touches a tree being
// moved (into it, out of it, of it) waits for the move (ErrConflict, and
// the caller tries again), or finishes it itself when its mover stopped
// touching it for RenameStale (it died); Reconcile finishes those too. A
// file created in the old tree while it moves is moved with it, unless
// its new name would be too long: it stays (and the log says so).

// SwapLimiter is an Index that bounds how many swaps one CompareAndSwap
// may carry.
type SwapLimiter interface {
	MaxSwaps() int
}

// RenameStale is how long an intent may go untouched before anyone
// finishes its rename.
const RenameStale = 30 * time.Second

// intentKey is the key of the intent: it starts with a NUL byte, which no
// name has, so no path reaches it, and listings of the root skip it.
const intentKey = "\x00rename"

// isInternal reports whether key is one of the store's hidden records.
func isInternal(key string) bool { return strings.HasPrefix(key, "\x00") }

// IsInternal reports whether key is one of the store's hidden records
// (watchers of the index skip them).
func IsInternal(key string) bool { return isInternal(key) }

const (
	xattrRenameFrom = "from"
	xattrRenameTo   = "to"
	xattrRenameNode = "node"
)

// maxSwaps returns the index's bound on swaps per CompareAndSwap (0: none).
func (s *Store) maxSwaps() int {
	if l, ok := s.opts.Index.(SwapLimiter); ok {
		return l.MaxSwaps()
	}
	return 0
}

// within reports whether key is dir or below it.
func within(key, dir string) bool {
	return key == dir || strings.HasPrefix(key, dir+"/")
}

// renamesInWay returns ErrConflict when a rename under way touches the
// trees of from or to, after finishing those whose mover went quiet.
func (s *Store) renamesInWay(ctx context.Context, from, to string) error {
	in, err := s.idx.Get(ctx, intentKey)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	src, dst := string(in.Xattrs[xattrRenameFrom]), string(in.Xattrs[xattrRenameTo])
	if !(within(from, src) || within(src, from) || within(from, dst) || within(dst, from) ||
		within(to, src) || within(src, to) || within(to, dst) || within(dst, to)) {
		return nil
	}
	if s.opts.Now().Sub(time.Unix(0, in.Mtime)) >= RenameStale {
		return s.finishRename(ctx, in)
	}
	return fmt.Errorf("rename %q to %q: %q is being moved to %q: %w", from, to, src, dst, ErrConflict)
}

// renameInSteps renames directory src (the Stat of from; Version 0 when
// implicit) to to, replacing the empty directory at to when dstVersion is
// not 0, in steps of at most limit swaps.
func (s *Store) renameInSteps(ctx context.Context, src *Object, to string, dstVersion uint64, replaced []*Object) error {
	from := src.Key
	intent := &Object{Key: intentKey, Kind: KindIntent, Ino: NewIno(), Mode: 0o600, Mtime: s.now(),
		Xattrs: map[string][]byte{xattrRenameFrom: []byte(from), xattrRenameTo: []byte(to), xattrRenameNode: []byte(s.opts.Node)}}
	intent.Ctime = intent.Mtime
	first := []Swap{{Key: intent.Key, New: intent}}
	var put []*Object
	var deleted []string
	if src.Version != 0 {
		n := s.movedTo(src, to)
		first = append(first, Swap{Key: from, Old: src.Version}, Swap{Key: to, Old: dstVersion, New: n})
		put, deleted = append(put, n), append(deleted, from)
	} else if dstVersion != 0 {
		first = append(first, Swap{Key: to, Old: dstVersion})
		deleted = append(deleted, to)
	}
	if _, err := s.idx.CompareAndSwap(ctx, first...); err != nil {
		// ErrConflict: the directory changed, or another stepped rename
		// began first; the caller looks again.
		return err
	}
	s.committed(replaced, put, deleted)
	return s.finishRename(ctx, intent)
}

// finishRename moves what is left of the tree of intent's rename and ends
// it. Several callers may run it for one intent at once: each step
// compares the intent's version, so one of them wins each step.
func (s *Store) finishRename(ctx context.Context, intent *Object) error {
	from, to := string(intent.Xattrs[xattrRenameFrom]), string(intent.Xattrs[xattrRenameTo])
	per := max((s.maxSwaps()-2)/2, 1)
	after := "" // past the entries left behind
	for {
		kids, err := s.idx.Scan(ctx, from+"/", after, per)
		if err != nil {
			return err
		}
		next := intent.Clone()
		next.Mtime = s.now()
		swaps := []Swap{{Key: intent.Key, Old: intent.Version, New: next}}
		var replaced, put []*Object
		var deleted []string
		last := len(kids) == 0
		if last {
			// The tree is empty: end the rename, keeping the old parent
			// if the tree was its last child.
			swaps = []Swap{{Key: intent.Key, Old: intent.Version}}
			if sw, err := s.keepParent(ctx, from, map[string]bool{}); err != nil {
				return err
			} else if sw != nil {
				swaps = append(swaps, *sw)
				put = append(put, sw.New)
			}
		}
		for _, k := range kids {
			dst := to + k.Key[len(from):]
			if len(dst) > MaxKeyLen {
				// Created since the rename began, with a name too long
				// for the new tree: it stays where it is.
				s.opts.Logf("rename %q to %q: %q stays, its new name would be %d B", from, to, k.Key, len(dst))
				after = k.Key + "\x00"
				continue
			}
			var old uint64
			if cur, err := s.idx.Get(ctx, dst); err == nil {
				// Created there since the rename began: replaced, as a
				// rename replaces its target.
				old = cur.Version
				replaced = append(replaced, cur)
			} else if !errors.Is(err, ErrNotFound) {
				return err
			}
			n := s.movedTo(k, dst)
			swaps = append(swaps, Swap{Key: k.Key, Old: k.Version}, Swap{Key: dst, Old: old, New: n})
			put, deleted = append(put, n), append(deleted, k.Key)
		}
		if !last && len(swaps) == 1 {
			continue // every entry of this batch stays where it is
		}
		_, err = s.idx.CompareAndSwap(ctx, swaps...)
		if errors.Is(err, ErrConflict) && ctx.Err() == nil {
			cur, gerr := s.idx.Get(ctx, intent.Key)
			if errors.Is(gerr, ErrNotFound) {
				return nil // another caller finished it
			}
			if gerr != nil {
				return gerr
			}
			intent = cur // another caller moved a step, or a file changed
			continue
		}
		if err != nil {
			return fmt.Errorf("rename %q to %q (in steps; finished later if not now): %w", from, to, err)
		}
		s.committed(replaced, put, deleted)
		if last {
			return nil
		}
		intent = next
	}
}

// resumeRenames finishes a rename whose mover went quiet.
func (s *Store) resumeRenames(ctx context.Context) error {
	in, err := s.idx.Get(ctx, intentKey)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil || s.opts.Now().Sub(time.Unix(0, in.Mtime)) < RenameStale {
		return err
	}
	if err := s.finishRename(ctx, in); err != nil {
		return err
	}
	s.opts.Logf("finished the rename of %q to %q that its mover (node %q) left",
		in.Xattrs[xattrRenameFrom], in.Xattrs[xattrRenameTo], in.Xattrs[xattrRenameNode])
	return nil
}
