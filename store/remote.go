package store

import (
	"context"
	"fmt"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Cluster mode: reading replicas of other nodes, and freeing this node's
// bodies when other nodes replace or delete their objects.
//
// # Remote readers
//
// An object with no replica on this node but one on another node is read
// through Options.Transport. Such a Reader holds no local body (no
// reference counts): Slices fails with ErrRemote and fs falls back to
// ReadAt / ReadTo.
//
// # Following the index
//
// With Options.Follow a goroutine consumes Index.Watch(ctx, "") and keeps,
// for every key, the local body (first extent) of its current version. An
// event that leaves a local body current under no key retires it, exactly
// as a local commit would: it is freed after its last local reader.
//
// A body is identified by its first extent, which is reused once the body
// is freed, and this store's own commits retire bodies synchronously, so
// the watch may report a change this store already applied. s.mu.live
// tells the two apart: it holds every committed, not yet retired local
// body with the version that published it (since). A watch retirement of
// a body observed at version V applies only if the body is still live and
// since <= V (a larger since is a later body in the same extents). A body
// is registered (since 0) before its commit's swap and gets its version
// after; a retirement that arrives in between is remembered (doomed) and
// applied then.
//
// Renames delete the old key and put the new one in one commit, so a body
// that lost its last key is retired only at the end of the commit (the
// event marked Last), if no key of that commit took it back.

// liveBody is the bookkeeping of one committed local body. Guarded by
// Store.mu.
type liveBody struct {
	since  uint64 // version that published it; 0 while its swap runs
	doomed uint64 // a follow retirement observed at this version waits for since
}

// registerBody notes ext as the body of a commit about to be swapped in.
func (s *Store) registerBody(ext []segment.Extent) {
	if len(ext) == 0 {
		return
	}
	s.mu.Lock()
	s.mu.live[ext[0]] = &liveBody{}
	s.mu.Unlock()
}

// unregisterBody forgets a registered body whose commit failed.
func (s *Store) unregisterBody(ext []segment.Extent) {
	if len(ext) == 0 {
		return
	}
	s.mu.Lock()
	if lb := s.mu.live[ext[0]]; lb != nil && lb.since == 0 {
		delete(s.mu.live, ext[0])
	}
	s.mu.Unlock()
}

// publishedBodyLocked records the version of a committed local body and
// applies a follow retirement that came in while the swap ran. The caller
// holds s.mu and a reference on the body.
func (s *Store) publishedBodyLocked(obj *Object) {
	ext := s.localExtents(obj)
	if len(ext) == 0 {
		return
	}
	lb := s.mu.live[ext[0]]
	if lb == nil {
		return
	}
	lb.since = obj.Version
	if lb.doomed >= lb.since {
		s.retireExtLocked(ext)
	}
}

// followRetireLocked retires the local body ext observed current at
// version ver, unless this store retired it already. Caller holds s.mu.
func (s *Store) followRetireLocked(ext []segment.Extent, ver uint64) {
	lb := s.mu.live[ext[0]]
	switch {
	case lb == nil:
		// Retired by this store's own commit (or never ours).
	case lb.since == 0:
		lb.doomed = max(lb.doomed, ver)
	case lb.since <= ver:
		s.retireExtLocked(ext)
	}
}

func (s *Store) startFollow() error {
	ctx, cancel := context.WithCancel(context.Background())
	ch, err := s.idx.Watch(ctx, "")
	if err != nil {
		cancel()
		return err
	}
	s.cancel = cancel
	s.follow.idle.Store(true)
	s.wg.Add(1)
	go s.followLoop(ch)
	return nil
}

// followRef is a local body seen current under a key at version ver.
type followRef struct {
	ext []segment.Extent
	ver uint64
}

type follower struct {
	s       *Store
	keys    map[string]followRef
	count   map[segment.Extent]int       // keys holding each body
	pending map[segment.Extent]followRef // bodies that lost their last key in the current commit
}

func (s *Store) followLoop(ch <-chan Event) {
	defer s.wg.Done()
	f := &follower{s: s, keys: map[string]followRef{},
		count: map[segment.Extent]int{}, pending: map[segment.Extent]followRef{}}
	for {
		select {
		case ev, ok := <-ch:
			if !ok {
				return
			}
			f.apply(ev)
			if ev.Last {
				f.flush()
			}
			s.follow.seen.Store(max(s.follow.seen.Load(), ev.Rev))
			s.follow.idle.Store(len(f.pending) == 0)
		case <-s.done:
			return
		}
	}
}

// apply updates the key map with one event and queues the bodies it left
// without a key.
func (f *follower) apply(ev Event) {
	key := ev.Object.Key
	var cur followRef
	if ev.Type == EventPut {
		if ext := f.s.localExtents(ev.Object); len(ext) > 0 {
			cur = followRef{ext: ext, ver: ev.Object.Version}
		}
	}
	prev, had := f.keys[key]
	if !had && ev.Type == EventDelete {
		// A version from before the watch started.
		if ext := f.s.localExtents(ev.Object); len(ext) > 0 {
			prev, had = followRef{ext: ext, ver: ev.Object.Version}, true
			f.count[ext[0]]++
		}
	}
	same := had && cur.ext != nil && prev.ext[0] == cur.ext[0]
	if had && !same {
		id := prev.ext[0]
		if f.count[id]--; f.count[id] <= 0 {
			delete(f.count, id)
			f.pending[id] = prev
			f.s.follow.idle.Store(false)
		}
	}
	if cur.ext == nil {
		delete(f.keys, key)
		return
	}
	if !same {
		f.count[cur.ext[0]]++
	}
	f.keys[key] = cur
}

// flush retires, at the end of a commit, the bodies it left without a key
// (a rename within the commit gave them one back).
func (f *follower) flush() {
	if len(f.pending) == 0 {
		return
	}
	f.s.mu.Lock()
	defer f.s.mu.Unlock()
	for id, ref := range f.pending {
		delete(f.pending, id)
		if f.count[id] > 0 {
			continue // moved (renamed) to another key
		}
		f.s.followRetireLocked(ref.ext, ref.ver)
	}
}

// remoteBody is a replica of another node that a Reader reads through
// the Transport.
type remoteBody struct {
	node    string
	extents []segment.Extent
	starts  []uint64
}

// remoteReplica returns a replica of obj on another node, or nil when
// there is none or no Transport.
func (s *Store) remoteReplica(obj *Object) *remoteBody {
	if s.opts.Transport == nil {
		return nil
	}
	for _, r := range obj.Replicas {
		if r.Node != s.opts.Node && segment.TotalLen(r.Extents) >= obj.Size {
			return &remoteBody{node: r.Node, extents: r.Extents, starts: extentStarts(r.Extents)}
		}
	}
	return nil
}

// readRemote fetches [off, off+buf.Size()) (clipped to the size) from the
// remote replica into buf's memory. Caller checked off < size.
func (r *Reader) readRemote(ctx context.Context, buf transfer.Buffer, off uint64) (uint64, error) {
	if buf.Kind != transfer.Host && buf.Kind != transfer.Registered {
		return 0, fmt.Errorf("read %q from node %q into %v memory: %w", r.obj.Key, r.remote.node, buf.Kind, ErrUnsupported)
	}
	n := min(buf.Size(), r.obj.Size-off)
	var err error
	span(r.remote.extents, r.remote.starts, off, n, func(e segment.Extent, rel uint64) bool {
		err = r.s.opts.Transport.ReadAt(ctx, r.remote.node, e, buf.Mem[rel:rel+e.Len])
		return err == nil
	})
	if err != nil {
		return 0, fmt.Errorf("read %q from node %q: %w", r.obj.Key, r.remote.node, err)
	}
	return n, nil
}

// fetchLocked copies the first keep bytes of a remote base into the
// draft's own extents. Caller holds d.mu and reserved keep bytes.
func (d *Draft) fetchLocked(ctx context.Context, base *Reader, keep uint64) error {
	var err error
	span(d.mu.ext, d.mu.starts, 0, keep, func(dst segment.Extent, rel uint64) bool {
		var m []byte
		if m, err = d.s.segs.Bytes(dst); err != nil {
			return false
		}
		_, err = base.readRemote(ctx, transfer.HostBuffer(m), rel)
		return err == nil
	})
	return err
}
