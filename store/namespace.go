package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"
)

// newObject builds a fresh object for key from an optional template.
func (s *Store) newObject(key string, kind Kind, t *Object) *Object {
	return s.newObjectAt(key, kind, t, s.now())
}

// newObjectAt is newObject made at time now.
func (s *Store) newObjectAt(key string, kind Kind, t *Object, now int64) *Object {
	return s.newObjectIn(new(Object), key, kind, t, now)
}

// newObjectIn is newObjectAt building the object in o (zero).
func (s *Store) newObjectIn(o *Object, key string, kind Kind, t *Object, now int64) *Object {
	*o = Object{Key: key, Kind: kind, Mode: 0o644}
	if kind == KindDir {
		o.Mode = 0o755
	}
	if t != nil {
		o.Mode, o.Uid, o.Gid, o.Ino, o.Pinned = t.Mode&0o7777, t.Uid, t.Gid, t.Ino, t.Pinned
		if len(t.Xattrs) > 0 {
			o.Xattrs = t.Clone().Xattrs
		}
	}
	if o.Ino == 0 {
		o.Ino = NewIno()
	}
	o.Mtime = now
	o.Ctime = now
	return o
}

// rootKey holds the root's attributes once they are changed (chmod,
// chown, utimes, xattrs of the mount's top): a hidden record, as the
// rename intents are, since key "" names no object in the index.
const rootKey = "\x00root"

// Stat returns the object of key. A key that has no object of its own but
// is the prefix of other keys is an implicit directory: Stat synthesizes
// it (Version 0). The root is key "": its record (rootKey) with Key "",
// or the defaults while it has none.
func (s *Store) Stat(ctx context.Context, key string) (*Object, error) {
	if key == "" {
		o, err := s.find(ctx, rootKey)
		if err != nil && !errors.Is(err, ErrNotFound) {
			return nil, err
		}
		if o == nil {
			return &Object{Key: "", Kind: KindDir, Ino: 1, Mode: 0o755, Mtime: s.started, Ctime: s.started}, nil
		}
		// A copy of the index's own object (read only), which is not the
		// index's: not its entry's.
		r := *o
		r.Key, r.slot = "", nil
		return &r, nil
	}
	o, has, err := s.findEntry(ctx, key)
	switch {
	case err != nil:
		return nil, err
	case o != nil:
		return o, nil
	case !has:
		return nil, &keyError{"stat", key, ErrNotFound}
	}
	return &Object{Key: key, Kind: KindDir, Ino: implicitIno(key), Mode: 0o755}, nil
}

// findEntry returns key's own object, or nil and whether keys lie under
// key, as one read where the index can (EntryFinder). Elsewhere a key
// found missing and then with keys under it is looked up once more: a
// rename of its directory back to key between the two reads left it
// there, its own object again.
func (s *Store) findEntry(ctx context.Context, key string) (*Object, bool, error) {
	if ef, ok := s.idx.(EntryFinder); ok {
		return ef.FindEntry(ctx, key)
	}
	o, err := s.find(ctx, key)
	if o != nil || err != nil {
		return o, false, err
	}
	has, err := s.hasChildren(ctx, key)
	if !has || err != nil {
		return nil, false, err
	}
	if o, err = s.find(ctx, key); o != nil || err != nil {
		return o, false, err
	}
	return nil, true, nil
}

// LookupMany sets objs[i] to keys[i]'s own object, nil for none, as
// Lookup finds it: all at once where the index can (ManyFinder). An error
// is the index's, with objs unspecified.
func (s *Store) LookupMany(ctx context.Context, keys []string, objs []*Object) error {
	if mf, ok := s.idx.(ManyFinder); ok && !slices.Contains(keys, "") {
		return mf.FindMany(ctx, keys, objs)
	}
	for i, k := range keys {
		o, err := s.Lookup(ctx, k)
		if err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		objs[i] = o
	}
	return nil
}

// Lookup returns key's own object, or ErrNotFound: unlike Stat it does
// not look for an implicit directory (HasChildren does).
func (s *Store) Lookup(ctx context.Context, key string) (*Object, error) {
	if key == "" {
		return s.Stat(ctx, key)
	}
	o, err := s.find(ctx, key)
	if o == nil && err == nil {
		return nil, ErrNotFound
	}
	return o, err
}

// find returns key's object, nil for none, without an error for a miss
// when the index can (Finder).
func (s *Store) find(ctx context.Context, key string) (*Object, error) {
	if f, ok := s.idx.(Finder); ok {
		return f.Find(ctx, key)
	}
	o, err := s.idx.Get(ctx, key)
	if errors.Is(err, ErrNotFound) {
		return nil, nil
	}
	return o, err
}

// HasChildren reports whether some key lies under key: whether key is a
// directory, implicit or not.
func (s *Store) HasChildren(ctx context.Context, key string) (bool, error) {
	return s.hasChildren(ctx, key)
}

// checkParent verifies that the directory that would hold key exists.
func (s *Store) checkParent(ctx context.Context, key string) error {
	p := Parent(key)
	if p == "" {
		return nil
	}
	o, err := s.Stat(ctx, p)
	if err != nil {
		return err
	}
	if o.Kind != KindDir {
		return fmt.Errorf("parent %q: %w", p, ErrNotDir)
	}
	return nil
}

// DirEntry is one child in a listing.
type DirEntry struct {
	Name string
	Kind Kind
	Ino  uint64
	// Object is the child's object; nil for implicit directories.
	Object *Object
}

// List returns the immediate children of directory dir in name order.
func (s *Store) List(ctx context.Context, dir string) ([]DirEntry, error) {
	var out []DirEntry
	for after := ""; ; {
		page, next, err := s.ListPage(ctx, dir, after, 256)
		if err != nil {
			return nil, err
		}
		out = append(out, page...)
		if next == "" {
			break
		}
		after = next
	}
	// Explicit entries and implicit ones arrive in key order, which is
	// name order except that a subtree "a/" sorts after "a.b"; sort to be
	// exact.
	sortEntries(out)
	return out, nil
}

// ListPage returns up to limit children of directory dir, in key order
// (name order but for a subtree "a/", which sorts after "a.b"), from
// position after on ("" for the first page), and the position of the
// next page ("" after the last). Positions are relative to dir, so a
// listing goes on where it was if dir is renamed meanwhile. A listing
// read a page at a time holds one page: a child added or removed
// meanwhile may or may not be in it, any other child is in it once.
func (s *Store) ListPage(ctx context.Context, dir, after string, limit int) ([]DirEntry, string, error) {
	if after == "" {
		d, err := s.Stat(ctx, dir)
		if err != nil {
			return nil, "", err
		}
		if d.Kind != KindDir {
			return nil, "", fmt.Errorf("list %q: %w", dir, ErrNotDir)
		}
	}
	prefix := ""
	if dir != "" {
		prefix = dir + "/"
	}
	from := prefix + after
	if from == "" {
		from = "\x01" // past the store's hidden records (rename.go)
	}
	limit = max(limit, 1)
	var out []DirEntry
	for len(out) < limit {
		objs, err := s.idx.Scan(ctx, prefix, from, limit-len(out))
		if err != nil {
			return nil, "", err
		}
		if len(objs) == 0 {
			return out, "", nil
		}
		for _, o := range objs {
			rest := o.Key[len(prefix):]
			i := strings.IndexByte(rest, '/')
			if i < 0 {
				out = append(out, DirEntry{Name: rest, Kind: o.Kind, Ino: o.Ino, Object: o})
				from = o.Key + "\x00"
				if len(out) == limit {
					break
				}
				continue
			}
			// A key below a child: the child is a directory, listed
			// here unless it is one of its own, whose key sorts before
			// its subtree. Its subtree is skipped: '0' follows '/'.
			name := rest[:i]
			from = prefix + name + "0"
			own, err := s.find(ctx, prefix+name)
			if err != nil {
				return nil, "", err
			}
			if own == nil {
				out = append(out, DirEntry{Name: name, Kind: KindDir, Ino: implicitIno(prefix + name)})
			}
			break // the rest of this scan is in the subtree
		}
	}
	return out, from[len(prefix):], nil
}

func sortEntries(es []DirEntry) {
	for i := 1; i < len(es); i++ {
		for j := i; j > 0 && es[j].Name < es[j-1].Name; j-- {
			es[j], es[j-1] = es[j-1], es[j]
		}
	}
}

// Create makes an empty file at key. Exclusive fails on an existing key;
// otherwise an existing file is returned as is.
func (s *Store) Create(ctx context.Context, key string, t *Object, exclusive bool) (*Object, error) {
	if err := ValidateKey(key); err != nil {
		return nil, fmt.Errorf("create %q: %w", key, err)
	}
	for {
		cur, err := s.Stat(ctx, key)
		switch {
		case err == nil && cur.Kind == KindDir:
			return nil, fmt.Errorf("create %q: %w", key, ErrIsDir)
		case err == nil && exclusive:
			return nil, fmt.Errorf("create %q: %w", key, ErrExists)
		case err == nil:
			return cur, nil
		case !errors.Is(err, ErrNotFound):
			return nil, err
		}
		if err := s.checkParent(ctx, key); err != nil {
			return nil, err
		}
		o := s.newObject(key, KindFile, t)
		s.inherit(ctx, o)
		if err := s.metaRoom("create", key, o.MetaBytes()); err != nil {
			return nil, err
		}
		if _, err := s.cas(ctx, Swap{Key: key, New: o, InDir: true}); err != nil {
			if errors.Is(err, ErrConflict) {
				continue
			}
			return nil, err
		}
		s.committed(nil, []*Object{o}, nil)
		return o, nil
	}
}

// Mkdir makes an explicit, empty directory.
func (s *Store) Mkdir(ctx context.Context, key string, t *Object) (*Object, error) {
	if err := ValidateKey(key); err != nil {
		return nil, fmt.Errorf("mkdir %q: %w", key, err)
	}
	if _, err := s.Stat(ctx, key); err == nil {
		return nil, fmt.Errorf("mkdir %q: %w", key, ErrExists)
	} else if !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	if err := s.checkParent(ctx, key); err != nil {
		return nil, err
	}
	o := s.newObject(key, KindDir, t)
	if err := s.metaRoom("mkdir", key, o.MetaBytes()); err != nil {
		return nil, err
	}
	if _, err := s.cas(ctx, Swap{Key: key, New: o, InDir: true}); err != nil {
		if errors.Is(err, ErrConflict) {
			return nil, fmt.Errorf("mkdir %q: %w", key, ErrExists)
		}
		return nil, err
	}
	return o, nil
}

func (s *Store) hasChildren(ctx context.Context, key string) (bool, error) {
	if cc, ok := s.idx.(ChildChecker); ok {
		return cc.HasChildren(ctx, key)
	}
	kids, err := s.idx.Scan(ctx, key+"/", "", 1)
	return len(kids) > 0, err
}

// movedTo returns o as a rename makes it at key to. A directory that
// was made explicit where it was implicit (keepParent, a chmod) bears
// the inode number its old key gives an implicit directory: once moved
// it takes a number of its own, since a later implicit directory at the
// old key gets that number again, and two directories of one inode
// number are one to the kernel (a directory inside itself).
func (s *Store) movedTo(o *Object, to string) *Object {
	n := o.Clone()
	n.Key, n.Ctime = to, s.now()
	if n.Kind == KindDir && n.Ino == implicitIno(o.Key) {
		n.Ino = NewIno()
	}
	return n
}

// keepParent returns a swap that materializes key's parent as an explicit
// directory when removing key (and the keys in gone) would leave it an
// empty implicit directory that vanishes: rm -r expects it to stay.
func (s *Store) keepParent(ctx context.Context, key string, gone map[string]bool) (*Swap, error) {
	p := Parent(key)
	if p == "" {
		return nil, nil
	}
	if _, err := s.idx.Get(ctx, p); err == nil {
		return nil, nil
	} else if !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	kids, err := s.idx.Scan(ctx, p+"/", "", len(gone)+1)
	if err != nil {
		return nil, err
	}
	for _, k := range kids {
		if !gone[k.Key] {
			return nil, nil
		}
	}
	d := s.newObject(p, KindDir, nil)
	d.Ino = implicitIno(p)
	return &Swap{Key: p, New: d}, nil
}

// removal returns the swaps that remove o, materializing its parent when
// o was the last child of an implicit directory.
func (s *Store) removal(ctx context.Context, o *Object) ([]Swap, error) {
	swaps := []Swap{{Key: o.Key, Old: o.Version}}
	sw, err := s.keepParent(ctx, o.Key, map[string]bool{o.Key: true})
	if err != nil {
		return nil, err
	}
	if sw != nil {
		swaps = append(swaps, *sw)
	}
	return swaps, nil
}

// Rmdir removes an empty directory.
func (s *Store) Rmdir(ctx context.Context, key string) error {
	for {
		o, err := s.Stat(ctx, key)
		if err != nil {
			return err
		}
		if o.Kind != KindDir {
			return fmt.Errorf("rmdir %q: %w", key, ErrNotDir)
		}
		if has, err := s.hasChildren(ctx, key); err != nil {
			return err
		} else if has {
			return fmt.Errorf("rmdir %q: %w", key, ErrNotEmpty)
		}
		swaps, err := s.removal(ctx, o)
		if err != nil {
			return err
		}
		// Still empty as it goes: a key made in it since the look above
		// makes it look again.
		swaps[0].CheckKids, swaps[0].Kids = true, 0
		if _, err := s.cas(ctx, swaps...); err != nil {
			if errors.Is(err, ErrConflict) {
				continue
			}
			return err
		}
		s.forgetDir(key)
		return nil
	}
}

// Delete removes the file at key. With ifIno not zero, only that object.
func (s *Store) Delete(ctx context.Context, key string, ifIno uint64) error {
	for {
		o, err := s.idx.Get(ctx, key)
		if err != nil {
			if errors.Is(err, ErrNotFound) {
				// A directory there (implicit: keys under it) says so; a
				// file made since the lookup was not there to delete.
				if d, serr := s.Stat(ctx, key); serr == nil && d.Kind == KindDir {
					return fmt.Errorf("delete %q: %w", key, ErrIsDir)
				}
			}
			return err
		}
		if o.Kind == KindDir {
			return fmt.Errorf("delete %q: %w", key, ErrIsDir)
		}
		if ifIno != 0 && o.Ino != ifIno {
			return fmt.Errorf("delete %q: %w", key, ErrStale)
		}
		swaps, err := s.removal(ctx, o)
		if err != nil {
			return err
		}
		if _, err := s.cas(ctx, swaps...); err != nil {
			if errors.Is(err, ErrConflict) {
				continue
			}
			return err
		}
		s.committed([]*Object{o}, nil, []string{key})
		return nil
	}
}

// Update changes the metadata of the object at key with fn (which gets a
// private copy) and swaps it in, retrying on conflicts. ifIno as in Delete.
// fn must not change Key, Kind, Ino, Size or Replicas.
func (s *Store) Update(ctx context.Context, key string, ifIno uint64, fn func(*Object) error) (*Object, error) {
	for try := 0; ; try++ {
		if try == maxUpdateTries {
			// Not a wait: a swap that can never succeed would spin here.
			return nil, fmt.Errorf("update %q: changed under %d tries: %w", key, try, ErrConflict)
		}
		o, err := s.Stat(ctx, key)
		if err != nil {
			return nil, err
		}
		if ifIno != 0 && o.Ino != ifIno {
			return nil, fmt.Errorf("update %q: %w", key, ErrStale)
		}
		n := o.Clone()
		if err := fn(n); err != nil {
			return nil, err
		}
		n.Key, n.Kind, n.Ino, n.Size, n.Replicas = o.Key, o.Kind, o.Ino, o.Size, o.Replicas
		n.Ctime = s.now()
		if grow, was := n.MetaBytes(), o.MetaBytes(); grow > was {
			if err := s.metaRoom("update", key, grow-was); err != nil {
				return nil, err
			}
		}
		in := n // what the index keeps: the root's under its record's key
		if key == "" {
			c := *n
			c.Key, in = rootKey, &c
		}
		if _, err := s.cas(ctx, Swap{Key: in.Key, Old: o.Version, New: in}); err != nil {
			if errors.Is(err, ErrConflict) {
				continue
			}
			return nil, err
		}
		n.Version = in.Version
		if o.Pinned && !n.Pinned && n.Kind == KindFile {
			// Eviction takes pinned files out of the LRU (forgetAt): back
			// in, as used now.
			s.Touch(n.Key)
		}
		return n, nil
	}
}

// maxUpdateTries bounds Update's swaps of one key that others keep
// changing.
const maxUpdateTries = 1000

// Rename flags, as in renameat2(2).
const (
	RenameNoReplace = 1 << 0
	RenameExchange  = 1 << 1
)

// Rename moves oldKey (a file or a whole directory) to newKey atomically,
// replacing a file or an empty directory there.
func (s *Store) Rename(ctx context.Context, oldKey, newKey string, flags uint32) error {
	if err := ValidateKey(newKey); err != nil {
		return fmt.Errorf("rename to %q: %w", newKey, err)
	}
	if flags&RenameExchange != 0 {
		return fmt.Errorf("rename exchange: %w", ErrUnsupported)
	}
	if flags&^uint32(RenameNoReplace) != 0 {
		return fmt.Errorf("rename flags %#x: %w", flags, ErrInvalid)
	}
	if oldKey == newKey {
		return nil
	}
	if strings.HasPrefix(newKey, oldKey+"/") {
		return fmt.Errorf("rename %q into itself: %w", oldKey, ErrInvalid)
	}
	for {
		if err := s.renamesInWay(ctx, oldKey, newKey); err != nil {
			if errors.Is(err, ErrConflict) && ctx.Err() == nil {
				// A tree this rename touches is being moved: wait for it.
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(10 * time.Millisecond):
				}
				continue
			}
			return err
		}
		src, err := s.Stat(ctx, oldKey)
		if err != nil {
			return err
		}
		dst, err := s.Stat(ctx, newKey)
		if err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		if err := s.checkParent(ctx, newKey); err != nil {
			return err
		}
		var swaps []Swap
		var replaced []*Object
		gone := map[string]bool{}
		if dst != nil {
			if flags&RenameNoReplace != 0 {
				return fmt.Errorf("rename to %q: %w", newKey, ErrExists)
			}
			switch {
			case src.Kind == KindFile && dst.Kind == KindDir:
				return fmt.Errorf("rename to %q: %w", newKey, ErrIsDir)
			case src.Kind == KindDir && dst.Kind == KindFile:
				return fmt.Errorf("rename to %q: %w", newKey, ErrNotDir)
			case dst.Kind == KindDir:
				if has, err := s.hasChildren(ctx, newKey); err != nil {
					return err
				} else if has {
					return fmt.Errorf("rename to %q: %w", newKey, ErrNotEmpty)
				}
			}
		}
		var dstVersion uint64
		if dst != nil {
			dstVersion = dst.Version
			replaced = append(replaced, dst)
		}
		// The new name's swap checks that its directory is still there
		// as the rename lands (InDir).
		move := func(o *Object, to string, old uint64) {
			n := s.movedTo(o, to)
			swaps = append(swaps, Swap{Key: o.Key, Old: o.Version}, Swap{Key: to, Old: old, New: n, InDir: to == newKey})
			gone[o.Key] = true
		}
		if src.Version != 0 {
			move(src, newKey, dstVersion)
		} else if dstVersion != 0 {
			// Implicit source directory over an explicit empty one.
			swaps = append(swaps, Swap{Key: newKey, Old: dstVersion, InDir: true})
		} else {
			swaps = append(swaps, Swap{Key: newKey, InDir: true}) // its checks alone
		}
		if src.Kind == KindDir {
			kids, err := s.idx.Scan(ctx, oldKey+"/", "", 0)
			if err != nil {
				return err
			}
			// The keys found are all there are as the rename lands: one
			// made in the old tree meanwhile makes it look again.
			if src.Version != 0 {
				swaps[0].CheckKids, swaps[0].Kids = true, len(kids)
			} else {
				swaps = append(swaps, Swap{Key: oldKey, CheckKids: true, Kids: len(kids)})
			}
			for _, k := range kids {
				to := newKey + k.Key[len(oldKey):]
				if len(to) > MaxKeyLen {
					return fmt.Errorf("rename %q to %q: %q would become %d B: %w", oldKey, newKey, k.Key, len(to), ErrNameTooLong)
				}
				move(k, to, 0)
			}
		}
		if lim := s.maxSwaps(); lim > 0 && len(swaps)+1 > lim && src.Kind == KindDir {
			// More than one index transaction holds: in steps (rename.go).
			err := s.renameInSteps(ctx, src, newKey, dstVersion, replaced)
			if errors.Is(err, ErrConflict) && ctx.Err() == nil {
				continue
			}
			if err == nil {
				s.noteRename(oldKey, newKey, true)
			}
			return err
		}
		if p := Parent(oldKey); p != "" && !strings.HasPrefix(newKey, p+"/") {
			if sw, err := s.keepParent(ctx, oldKey, gone); err != nil {
				return err
			} else if sw != nil {
				swaps = append(swaps, *sw)
			}
		}
		// Not s.cas: the keys below a directory are made anew under its
		// new key, but only the two parents' entries changed.
		if _, err := s.idx.CompareAndSwap(ctx, swaps...); err != nil {
			if errors.Is(err, ErrConflict) {
				continue
			}
			return err
		}
		s.noteRename(oldKey, newKey, src.Kind == KindDir)
		var put []*Object
		var deleted []string
		for _, sw := range swaps {
			if sw.New != nil {
				put = append(put, sw.New)
			} else {
				deleted = append(deleted, sw.Key)
			}
		}
		s.committed(replaced, put, deleted)
		return nil
	}
}
