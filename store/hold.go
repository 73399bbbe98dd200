package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Holds: a Reader keeps its version readable until Close. For a local body
// that is a reference (acquireLocked); for a body on another node it is a
// hold the owner grants through the transport. Readers do not ask for one
// at open: most close long before their version is replaced. The follow
// loop asks, for the open readers of a key, when it sees that key replaced
// or removed; the owner keeps a retired body readable for FreeDelay, which
// leaves the request time to arrive. The reapLoop renews holds while their
// readers are open; Close releases them; a hold whose holder died ends
// with its TTL.

// HoldTTL is how long a hold lasts without renewal.
const HoldTTL = 30 * time.Second

// bodyHold is a hold another node's reader has on a local body.
type bodyHold struct {
	first    segment.Extent
	deadline time.Time
}

// heldRef is a hold this node's reader has on another node's body.
type heldRef struct {
	node      string
	epoch, id uint64
}

// holdBody grants a hold on the body whose first extent is first (at
// version) for ttl.
func (s *Store) holdBody(ctx context.Context, first segment.Extent, version uint64, ttl time.Duration) (uint64, error) {
	if err := s.caughtUp(ctx, version); err != nil {
		return 0, fmt.Errorf("hold body %v: %w", first, err)
	}
	s.mu.Lock()
	b, err := s.settledLocked(ctx, first)
	if err != nil {
		return 0, fmt.Errorf("hold body %v: %w", first, err)
	}
	defer s.mu.Unlock()
	if !b.readableLocked(version) {
		return 0, fmt.Errorf("hold body %v at version %d: %w", first, version, transfer.ErrStaleBody)
	}
	s.mu.nextResv++
	id := s.mu.nextResv
	s.mu.holds[id] = &bodyHold{first: first, deadline: s.opts.Now().Add(ttl)}
	b.pinLocked()
	return id, nil
}

// releaseHoldLocked ends hold id; a retired body is freed when its last
// hold ends. Caller holds s.mu.
func (s *Store) releaseHoldLocked(id uint64) bool {
	h := s.mu.holds[id]
	if h == nil {
		return false
	}
	delete(s.mu.holds, id)
	s.unpinLocked(h.first)
	return true
}

// watchRemoteReaderLocked notes an open reader whose bytes are on another
// node. Caller holds s.mu.
func (s *Store) watchRemoteReaderLocked(r *Reader) {
	m := s.mu.remoteReaders[r.obj.Key]
	if m == nil {
		m = map[*Reader]struct{}{}
		s.mu.remoteReaders[r.obj.Key] = m
	}
	m[r] = struct{}{}
}

// closeRemoteReader forgets r and releases its holds.
func (s *Store) closeRemoteReader(r *Reader) {
	s.mu.Lock()
	if m := s.mu.remoteReaders[r.obj.Key]; m != nil {
		delete(m, r)
		if len(m) == 0 {
			delete(s.mu.remoteReaders, r.obj.Key)
		}
	}
	holds := r.holds
	r.holds = nil
	s.mu.Unlock()
	if len(holds) > 0 {
		go s.releaseHolds(holds)
	}
}

func (s *Store) releaseHolds(holds []heldRef) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, h := range holds {
		if err := s.opts.Transport.Release(ctx, h.node, h.epoch, h.id); err != nil && !errors.Is(err, transfer.ErrUnknownReservation) {
			s.opts.Logf("release hold %d on node %q: %v", h.id, h.node, err)
		}
	}
}

// holdReadersOf asks the owners to hold the bodies of key's open readers
// that a change of key leaves behind: cur is the key's new version, nil
// when it was removed. A new version that keeps a reader's bytes (a
// metadata change) asks nothing. The follow loop calls it; the calls run
// in the background.
func (s *Store) holdReadersOf(key string, cur *Object) {
	s.mu.Lock()
	var todo []*Reader
	for r := range s.mu.remoteReaders[key] {
		if r.holding || (cur != nil && (cur.Version <= r.obj.Version || keepsBodies(cur, r.remote))) {
			continue
		}
		r.holding = true
		todo = append(todo, r)
	}
	s.mu.Unlock()
	for _, r := range todo {
		go s.holdReader(r)
	}
}

// keepsBodies reports whether o still has every replica of rb, same node,
// same first extent.
func keepsBodies(o *Object, rb *remoteBody) bool {
	for _, rep := range rb.replicas {
		found := false
		for _, r := range o.Replicas {
			if r.Node == rep.Node && len(r.Extents) > 0 && r.Extents[0] == rep.Extents[0] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}

// holdReader takes a hold on every remote replica of r's version.
func (s *Store) holdReader(r *Reader) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var got []heldRef
	for _, rep := range r.remote.replicas {
		id, err := s.opts.Transport.Hold(ctx, rep.Node, rep.Epoch, rep.Extents[0], r.obj.Version, HoldTTL)
		if err != nil {
			s.opts.Logf("hold %q version %d on node %q for an open reader: %v", r.obj.Key, r.obj.Version, rep.Node, err)
			continue
		}
		got = append(got, heldRef{node: rep.Node, epoch: rep.Epoch, id: id})
	}
	s.mu.Lock()
	closed := r.closed.Load()
	if !closed {
		r.holds = append(r.holds, got...)
	}
	s.mu.Unlock()
	if closed && len(got) > 0 {
		s.releaseHolds(got)
	}
}

// renewHolds extends every hold of this node's open readers.
func (s *Store) renewHolds() {
	s.mu.Lock()
	var all []heldRef
	for _, m := range s.mu.remoteReaders {
		for r := range m {
			all = append(all, r.holds...)
		}
	}
	s.mu.Unlock()
	if len(all) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, h := range all {
		if err := s.opts.Transport.Renew(ctx, h.node, h.epoch, h.id, HoldTTL); err != nil {
			s.opts.Logf("renew hold %d on node %q: %v", h.id, h.node, err)
		}
	}
}
