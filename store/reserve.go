package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Remote allocation, owner side: this store reserves extents for writers
// on other nodes (transfer.Controller). A reservation lives until its
// deadline; a commit that names its extents, seen by the follow loop,
// turns them into a live body of this node (then freed like any other when
// replaced or deleted); whatever is still reserved at the deadline is
// freed by the reaper. Guarded by Store.mu.

type reservation struct {
	ext      []segment.Extent
	deadline time.Time
	// writes in flight into it (BeginWrite); while there are any it is
	// neither reaped nor freed: a free marks it dead and the last write
	// frees what is left.
	writes int
	dead   bool
}

var _ transfer.WriteGuard = (*Store)(nil)

// BeginWrite implements transfer.WriteGuard: e must lie in one extent of
// reservation id, which must not have passed its deadline.
func (s *Store) BeginWrite(id uint64, e segment.Extent) (func(), error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.mu.resv[id]
	if r == nil {
		return nil, fmt.Errorf("write %v: reservation %d: %w", e, id, transfer.ErrNotReserved)
	}
	if s.opts.Now().After(r.deadline) {
		return nil, fmt.Errorf("write %v: reservation %d expired: %w", e, id, transfer.ErrNotReserved)
	}
	if _, err := carve(r.ext, e); err != nil {
		return nil, fmt.Errorf("write %v: not in reservation %d: %w", e, id, transfer.ErrNotReserved)
	}
	r.writes++
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		if r.writes--; r.writes == 0 && r.dead {
			_ = s.segs.Free(r.ext)
			r.ext = nil
		}
	}, nil
}

// dropResvLocked forgets reservation id and frees what is left of it, or,
// with writes in flight, leaves that to the last one. Caller holds s.mu.
func (s *Store) dropResvLocked(id uint64, r *reservation) {
	delete(s.mu.resv, id)
	if r.writes > 0 {
		r.dead = true
		return
	}
	_ = s.segs.Free(r.ext)
	r.ext = nil
}

// MaxReserveTTL bounds a reservation's lifetime between renewals.
const MaxReserveTTL = 10 * time.Minute

var _ transfer.Controller = (*Store)(nil)

// Control implements transfer.Controller.
func (s *Store) Control(ctx context.Context, req transfer.ControlRequest) (transfer.ControlResponse, error) {
	ttl := min(time.Duration(req.TTLMillis)*time.Millisecond, MaxReserveTTL)
	switch req.Op {
	case transfer.CtlReserve:
		ext, err := s.alloc(req.Bytes)
		if err != nil {
			if errors.Is(err, ErrUnavailable) {
				// Full, and eviction waits for the index: the asker's
				// user gets a timeout, as a local write would.
				return transfer.ControlResponse{}, errors.Join(transfer.ErrIndexUnavailable, err)
			}
			return transfer.ControlResponse{}, errors.Join(transfer.ErrNoSpace, err)
		}
		s.mu.Lock()
		s.mu.nextResv++
		id := s.mu.nextResv
		s.mu.resv[id] = &reservation{ext: ext, deadline: s.opts.Now().Add(ttl)}
		s.mu.Unlock()
		s.stats.reserved.Add(1)
		return transfer.ControlResponse{ID: id, Extents: ext, TTLMillis: ttl.Milliseconds()}, nil
	case transfer.CtlRenew:
		s.mu.Lock()
		defer s.mu.Unlock()
		if h := s.mu.holds[req.ID]; h != nil {
			h.deadline = s.opts.Now().Add(ttl)
			return transfer.ControlResponse{}, nil
		}
		r := s.mu.resv[req.ID]
		if r == nil {
			return transfer.ControlResponse{}, fmt.Errorf("reservation %d: %w", req.ID, transfer.ErrUnknownReservation)
		}
		r.deadline = s.opts.Now().Add(ttl)
		return transfer.ControlResponse{TTLMillis: ttl.Milliseconds()}, nil
	case transfer.CtlHold:
		id, err := s.holdBody(ctx, req.Extents[0], req.Version, ttl)
		return transfer.ControlResponse{ID: id}, err
	case transfer.CtlRelease:
		s.mu.Lock()
		defer s.mu.Unlock()
		if !s.releaseHoldLocked(req.ID) {
			return transfer.ControlResponse{}, fmt.Errorf("hold %d: %w", req.ID, transfer.ErrUnknownReservation)
		}
		return transfer.ControlResponse{}, nil
	case transfer.CtlSync:
		// The committer waits SyncTimeout at most; so does this side.
		ctx, cancel := context.WithTimeout(ctx, SyncTimeout)
		defer cancel()
		return transfer.ControlResponse{}, s.caughtUp(ctx, req.Rev)
	case transfer.CtlFree:
		s.mu.Lock()
		defer s.mu.Unlock()
		r := s.mu.resv[req.ID]
		if r == nil {
			return transfer.ControlResponse{}, fmt.Errorf("reservation %d: %w", req.ID, transfer.ErrUnknownReservation)
		}
		if len(req.Extents) == 0 {
			s.dropResvLocked(req.ID, r)
			return transfer.ControlResponse{}, nil
		}
		if r.writes > 0 {
			// A write in flight may be into what would be freed.
			return transfer.ControlResponse{}, fmt.Errorf("free part of reservation %d with %d writes in flight: %w", req.ID, r.writes, transfer.ErrBadRequest)
		}
		// Check all first: a bad extent changes nothing.
		rest := r.ext
		for _, f := range req.Extents {
			var err error
			if rest, err = carve(rest, f); err != nil {
				return transfer.ControlResponse{}, fmt.Errorf("free %v of reservation %d: %w", f, req.ID, err)
			}
		}
		r.ext = rest
		_ = s.segs.Free(req.Extents)
		if len(r.ext) == 0 {
			delete(s.mu.resv, req.ID)
		}
		return transfer.ControlResponse{}, nil
	}
	return transfer.ControlResponse{}, fmt.Errorf("control op %q: %w", req.Op, transfer.ErrBadRequest)
}

// carve removes f from the extent list, which must contain it within one
// extent; the rest of that extent stays.
func carve(list []segment.Extent, f segment.Extent) ([]segment.Extent, error) {
	if f.Len == 0 {
		return nil, fmt.Errorf("empty extent: %w", transfer.ErrBadRequest)
	}
	for i, e := range list {
		if e.Segment != f.Segment || f.Off < e.Off || f.Off+f.Len > e.Off+e.Len || f.Off+f.Len < f.Off {
			continue
		}
		out := append([]segment.Extent(nil), list[:i]...)
		if f.Off > e.Off {
			out = append(out, segment.Extent{Segment: e.Segment, Off: e.Off, Len: f.Off - e.Off})
		}
		if end := f.Off + f.Len; end < e.Off+e.Len {
			out = append(out, segment.Extent{Segment: e.Segment, Off: end, Len: e.Off + e.Len - end})
		}
		return append(out, list[i+1:]...), nil
	}
	return nil, fmt.Errorf("not reserved: %w", transfer.ErrBadRequest)
}

// consumeLocked takes the extents of a committed body out of the
// reservations that hold them and makes the body live at version ver. It
// reports whether any extent was reserved. Caller holds s.mu.
func (s *Store) consumeLocked(ext []segment.Extent, ver uint64) bool {
	if len(s.mu.resv) == 0 || len(ext) == 0 {
		return false
	}
	found := false
	for _, e := range ext {
		for id, r := range s.mu.resv {
			rest, err := carve(r.ext, e)
			if err != nil {
				continue
			}
			found = true
			r.ext = rest
			if len(rest) == 0 {
				delete(s.mu.resv, id)
			}
			break
		}
	}
	if found {
		if s.bodyLocked(ext[0]) == nil {
			s.addBodyLocked(newBody(ext, bodyLive, ver))
		}
	}
	return found
}

// reapLoop frees reservations and ends holds whose deadline passed.
func (s *Store) reapLoop() {
	defer s.wg.Done()
	t := time.NewTicker(min(time.Second, s.reserveTTL()/6))
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
			s.reap()
		}
	}
}

func (s *Store) reap() {
	now := s.opts.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, r := range s.mu.resv {
		if now.After(r.deadline) && r.writes == 0 {
			s.dropResvLocked(id, r)
			s.stats.reaped.Add(1)
		}
	}
	for id, h := range s.mu.holds {
		if now.After(h.deadline) {
			s.releaseHoldLocked(id)
		}
	}
}

// copyExtents copies the first n bytes of src into dst (each a node, its
// epoch and extents): straight from or into local segment memory when one
// side is here, through a bounce buffer otherwise. A remote dst's
// extents lie in the reservations dstResv names (one per extent). A
// remote src is read checked against version (see transfer.BodyChecker)
// unless it is 0.
func (s *Store) copyExtents(ctx context.Context, src, dst Replica, dstResv []uint64, n, version uint64) error {
	var body segment.Extent
	if len(src.Extents) > 0 {
		body = src.Extents[0]
	}
	srcStarts, dstStarts := extentStarts(src.Extents), extentStarts(dst.Extents)
	var reqs []transfer.Request
	var err error
	// across moves the bytes between here (the local replica, its segment
	// memory as the buffer) and there with op: a write of here into there,
	// or a read of there (checked against ver) into here.
	across := func(here, there Replica, hereStarts, thereStarts []uint64, op transfer.Op, ver uint64) {
		var checked segment.Extent
		if ver != 0 {
			checked = body
		}
		span(here.Extents, hereStarts, 0, n, func(he segment.Extent, rel uint64) bool {
			var m []byte
			if m, err = s.segs.Bytes(he); err != nil {
				return false
			}
			spanIdx(there.Extents, thereStarts, rel, he.Len, func(i int, te segment.Extent, r2 uint64) bool {
				req := transfer.Request{Op: op, Buf: transfer.HostBuffer(m), BufOff: r2, Extent: te,
					Node: there.Node, Epoch: there.Epoch, Body: checked, Version: ver}
				if op == transfer.Write {
					req.Resv = dstResv[i]
				}
				reqs = append(reqs, req)
				return true
			})
			return true
		})
	}
	switch {
	case s.isLocal(src.Node):
		across(src, dst, srcStarts, dstStarts, transfer.Write, 0)
	case s.isLocal(dst.Node):
		across(dst, src, dstStarts, srcStarts, transfer.Read, version)
	default:
		const chunk = 4 << 20
		stage := make([]byte, min(n, chunk))
		for off := uint64(0); off < n && err == nil; off += chunk {
			k := min(chunk, n-off)
			buf := transfer.HostBuffer(stage[:k])
			var rd, wr []transfer.Request
			span(src.Extents, srcStarts, off, k, func(se segment.Extent, rel uint64) bool {
				rd = append(rd, transfer.Request{Op: transfer.Read, Buf: buf, BufOff: rel, Extent: se, Node: src.Node, Epoch: src.Epoch,
					Body: body, Version: version})
				return true
			})
			spanIdx(dst.Extents, dstStarts, off, k, func(i int, de segment.Extent, rel uint64) bool {
				wr = append(wr, transfer.Request{Op: transfer.Write, Buf: buf, BufOff: rel, Extent: de, Node: dst.Node, Epoch: dst.Epoch,
					Resv: dstResv[i]})
				return true
			})
			if err = s.eng.Submit(ctx, rd); err == nil {
				err = s.eng.Submit(ctx, wr)
			}
		}
		return err
	}
	if err != nil {
		return err
	}
	return s.eng.Submit(ctx, reqs)
}
