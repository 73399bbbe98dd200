package store

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

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
// the watch may report a change this store already applied. The body's
// record (body.go) tells the two apart: a watch retirement of a body
// observed at version V applies only if the body is still live and was
// published at or before V (a later one is another body in the same
// extents). A body is registered before its commit's swap and gets its
// version after; a retirement that arrives in between is remembered
// (doomed) and applied then.
//
// Renames delete the old key and put the new one in one commit, so a body
// that lost its last key is retired only at the end of the commit (the
// event marked Last), if no key of that commit took it back.

// registerBody notes ext as the body of a commit about to be swapped in,
// and returns its record (nil for none).
func (s *Store) registerBody(ext []segment.Extent) *body {
	if len(ext) == 0 {
		return nil
	}
	b := newBody(ext, bodyRegistered, 0)
	s.mu.Lock()
	s.addBodyLocked(b)
	s.mu.Unlock()
	return b
}

// unregisterBody forgets a registered body whose commit failed (its
// extents go back with the draft's).
func (s *Store) unregisterBody(ext []segment.Extent) {
	if len(ext) == 0 {
		return
	}
	s.mu.Lock()
	if b := s.bodyLocked(ext[0]); b != nil && b.state == bodyRegistered {
		s.dropBodyLocked(b)
	}
	s.mu.Unlock()
}

// publishedBodyLocked records the version of a committed local body and
// applies a retirement that came in while the swap ran. The caller holds
// s.mu and, when it keeps using the body, a reference on it.
func (s *Store) publishedBodyLocked(obj *Object) {
	ext := s.localExtents(obj)
	if len(ext) == 0 {
		return
	}
	b := s.bodyOfLocked(obj, ext[0])
	if b == nil || b.state != bodyRegistered {
		return
	}
	b.state, b.since = bodyLive, obj.Version
	if b.doomed >= b.since {
		s.retireBodyLocked(b)
	}
}

// followRetireLocked retires the local body ext observed current at
// version ver, unless this store retired it already. Caller holds s.mu.
func (s *Store) followRetireLocked(ext []segment.Extent, ver uint64) {
	b := s.bodyLocked(ext[0])
	switch {
	case b == nil:
		// Retired by this store's own commit (or never ours).
	case b.state == bodyRegistered:
		b.doomed = max(b.doomed, ver)
	case b.since <= ver:
		s.retireBodyLocked(b)
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
			// Written here by another node: its reservation becomes a
			// live body.
			f.s.mu.Lock()
			f.s.consumeLocked(ext, ev.Object.Version)
			if b := f.s.bodyLocked(ext[0]); b != nil {
				b.key = key // for CheckBody's LRU touch
			}
			f.s.mu.Unlock()
		}
	}
	// Open readers of the key's previous version on other nodes' bodies
	// ask those nodes to keep them.
	if ev.Type == EventDelete {
		f.s.holdReadersOf(key, nil)
	} else {
		f.s.holdReadersOf(key, ev.Object)
	}
	// The LRU holds every key with bytes here, whichever node wrote
	// them, so that eviction can make room for the next write.
	if cur.ext != nil && ev.Object.Kind == KindFile {
		f.s.Touch(key)
		f.s.kickEvict()
	} else {
		f.s.forget(key)
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

var _ transfer.BodyChecker = (*Store)(nil)

// CheckBody implements transfer.BodyChecker for checked reads by other
// nodes: the body whose first extent is first must be live here and
// published at version or before (a later body in the same extents is
// another object's), or retired and not yet freed. It first lets the
// follow loop catch up with version, so a reader that saw a commit before
// this node did is not refused. The body is then pinned, as a hold pins
// it, until release: a retirement meanwhile frees it only after the
// stream ended.
func (s *Store) CheckBody(ctx context.Context, first segment.Extent, version uint64) (func(), error) {
	if err := s.caughtUp(ctx, version); err != nil {
		return nil, fmt.Errorf("body %v: %w", first, err)
	}
	s.mu.Lock()
	b, err := s.settledLocked(ctx, first)
	if err != nil {
		return nil, fmt.Errorf("body %v: %w", first, err)
	}
	ok := b.readableLocked(version)
	var key string
	if ok {
		b.pinLocked()
		if b.state == bodyLive {
			key = b.key
		}
	}
	s.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("body %v at version %d: %w", first, version, transfer.ErrStaleBody)
	}
	if key != "" {
		// A read from another node is a use of this node's copy.
		s.Touch(key)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			s.unpinLocked(first)
			s.mu.Unlock()
		})
	}, nil
}

// caughtUp returns once the follow loop has processed every change up to
// version rev (at once without Follow).
func (s *Store) caughtUp(ctx context.Context, rev uint64) error {
	for wait := 50 * time.Microsecond; s.opts.Follow && s.follow.seen.Load() < rev; wait = min(2*wait, 5*time.Millisecond) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("this node has not seen version %d (at %d): %w", rev, s.follow.seen.Load(), ctx.Err())
		case <-time.After(wait):
		}
	}
	return nil
}

// sharedIndex is the Index of a clustered store: a commit returns once
// every other live node has it in its view (CtlSync over the transport),
// so whoever reads on another node after the commit returned sees it
// there, from that node's cache, without asking the index. A node that
// does not answer within SyncTimeout is not waited for (it is dead or cut
// off, and gone from the membership soon).
type sharedIndex struct {
	Index
	s *Store
}

// SyncTimeout bounds how long a commit waits for one other node;
// SyncBackoff is how long a node that did not confirm is not waited for.
const (
	SyncTimeout = 2 * time.Second
	SyncBackoff = 5 * time.Second
)

func (x *sharedIndex) CompareAndSwap(ctx context.Context, swaps ...Swap) (uint64, error) {
	rev, err := x.Index.CompareAndSwap(ctx, swaps...)
	if err == nil {
		x.s.swappedBodies(rev, swaps)
		x.s.propagate(ctx, rev)
	}
	return rev, err
}

// swappedBodies notes the version of the local bodies a swap just put in.
func (s *Store) swappedBodies(rev uint64, swaps []Swap) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, sw := range swaps {
		if sw.New == nil {
			continue
		}
		if ext := s.localExtents(sw.New); len(ext) > 0 {
			if b := s.bodyLocked(ext[0]); b != nil && b.state == bodyRegistered {
				b.swapped = rev
			}
		}
	}
}

// propagate waits until every other live node has seen rev. A node that
// failed to confirm is not waited for again for SyncBackoff (it is cut
// off or misconfigured: commits must not pay SyncTimeout each).
func (s *Store) propagate(ctx context.Context, rev uint64) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), SyncTimeout)
	defer cancel()
	now := s.opts.Now()
	var wg sync.WaitGroup
	for _, n := range s.opts.Cluster.Nodes() {
		if s.isLocal(n.Name) {
			continue
		}
		s.mu.Lock()
		skip := now.Before(s.mu.syncSkip[n.Name])
		s.mu.Unlock()
		if skip {
			continue
		}
		wg.Go(func() {
			if err := s.opts.Transport.Sync(ctx, n.Name, rev); err != nil {
				s.stats.syncFails.Add(1)
				s.mu.Lock()
				s.mu.syncSkip[n.Name] = s.opts.Now().Add(SyncBackoff)
				s.mu.Unlock()
			}
		})
	}
	wg.Wait()
}

// remoteBody is the replicas of other nodes that a Reader reads through
// the Transport, in order of preference: a failed read goes on to the next.
type remoteBody struct {
	replicas []Replica
	starts   [][]uint64
}

// remoteReplicas returns obj's full replicas on other nodes, or nil when
// there is none or no Transport.
func (s *Store) remoteReplicas(obj *Object) *remoteBody {
	if s.opts.Transport == nil {
		return nil
	}
	var rb remoteBody
	for _, r := range obj.Replicas {
		if r.Node != s.opts.Node && segment.TotalLen(r.Extents) >= obj.Size {
			rb.replicas = append(rb.replicas, r)
			rb.starts = append(rb.starts, extentStarts(r.Extents))
		}
	}
	if len(rb.replicas) == 0 {
		return nil
	}
	return &rb
}

// replica returns where the reader's bytes are: the local body, or the
// first remote replica.
func (r *Reader) replica() Replica {
	if r.remote != nil {
		return r.remote.replicas[0]
	}
	here := Replica{Node: r.s.opts.Node, Epoch: r.s.opts.Epoch}
	if r.b != nil {
		here.Extents = r.b.extents
	}
	return here
}

// readRemote fetches [off, off+buf.Size()) (clipped to the size) from a
// remote replica into buf, trying each replica in turn. Caller checked
// off < size.
func (r *Reader) readRemote(ctx context.Context, buf transfer.Buffer, off uint64) (uint64, error) {
	n := min(buf.Size(), r.obj.Size-off)
	var errs []error
	for i, rep := range r.remote.replicas {
		var reqs []transfer.Request
		span(rep.Extents, r.remote.starts[i], off, n, func(e segment.Extent, rel uint64) bool {
			reqs = append(reqs, transfer.Request{Op: transfer.Read, Buf: buf, BufOff: rel, Extent: e, Node: rep.Node, Epoch: rep.Epoch,
				Body: rep.Extents[0], Version: r.obj.Version})
			return true
		})
		err := r.s.eng.Submit(ctx, reqs)
		if err == nil {
			return n, nil
		}
		errs = append(errs, fmt.Errorf("from node %q: %w", rep.Node, err))
		if ctx.Err() != nil {
			break
		}
	}
	return 0, fmt.Errorf("read %q: %w", r.obj.Key, errors.Join(errs...))
}

// replicate makes k more copies of the n bytes of primary, on distinct
// other live nodes. On error nothing stays reserved.
func (s *Store) replicate(ctx context.Context, primary Replica, n uint64, k int) ([]Replica, []transfer.Reservation, error) {
	if s.opts.Transport == nil {
		return nil, nil, fmt.Errorf("%d replicas wanted: %w", k+1, errors.Join(ErrNoSpace, errNoTransport))
	}
	nodes, err := s.replicaNodes(k, map[string]bool{primary.Node: true}, nil)
	if err != nil {
		return nil, nil, err
	}
	return s.replicateFrom(ctx, primary, n, 0, nodes)
}

// replicateFrom copies the n bytes of src, a replica of an object at
// version (0: the draft's own, unchecked), to each of nodes.
func (s *Store) replicateFrom(ctx context.Context, src Replica, n, version uint64, nodes []string) ([]Replica, []transfer.Reservation, error) {
	var err error
	size := (n + segment.Granule - 1) / segment.Granule * segment.Granule
	var reps []Replica
	var resv []transfer.Reservation
	fail := func(err error) ([]Replica, []transfer.Reservation, error) {
		s.freeReservations(ctx, resv)
		return nil, nil, err
	}
	for _, node := range nodes {
		dst := Replica{Node: node}
		if s.isLocal(node) {
			if dst.Extents, err = s.alloc(size); err != nil {
				return fail(err)
			}
			dst.Epoch = s.opts.Epoch
			resv = append(resv, transfer.Reservation{Node: node, Extents: dst.Extents})
		} else {
			r, err := s.reserveRemote(ctx, node, size)
			if err != nil {
				return fail(fmt.Errorf("replica on node %q: %w", node, err))
			}
			resv = append(resv, r)
			dst.Epoch, dst.Extents = r.Epoch, r.Extents
		}
		if err := s.copyExtents(ctx, src, dst, sameResv(resv[len(resv)-1]), n, version); err != nil {
			return fail(fmt.Errorf("replica on node %q: %w", node, err))
		}
		reps = append(reps, dst)
	}
	return reps, resv, nil
}

// freeReservations gives back reservations (local ones: allocations) that
// did not become part of a commit, and ends their leases.
func (s *Store) freeReservations(ctx context.Context, resv []transfer.Reservation) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	for _, r := range resv {
		if s.isLocal(r.Node) {
			_ = s.segs.Free(r.Extents)
		} else if s.opts.Transport != nil {
			s.endLease(r.Node, r.Epoch, r.ID)
			_ = s.opts.Transport.Free(ctx, r.Node, r.Epoch, r.ID, nil)
		}
	}
}

// sameResv lists r's id once per extent of r: the reservation each extent
// of a copy's destination lies in.
func sameResv(r transfer.Reservation) []uint64 {
	ids := make([]uint64, len(r.Extents))
	for i := range ids {
		ids[i] = r.ID
	}
	return ids
}
