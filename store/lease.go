package store

import (
	"context"
	"errors"
	"time"

	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Writer side of remote reservations. Every reservation this node holds
// on another node, for a draft's bytes or a replica being copied, is a
// lease here from the Reserve that made it until it is given back (freed)
// or handed over (committed: the owner takes the extents over when its
// follow loop sees the commit). The reap loop renews leases every third
// of Options.ReserveTTL, so a reservation lives as long as its writer,
// however slow; the owner refuses writes outside live reservations
// (transfer.WriteGuard), so a write that outlived its reservation (its
// writer was cut off) fails instead of landing in memory given to another
// object. A handed-over lease is renewed until the owner no longer knows
// it (it consumed the reservation), which covers an owner that sees the
// commit late. Guarded by Store.mu.

// DefaultReserveTTL is Options.ReserveTTL's default.
const DefaultReserveTTL = 30 * time.Second

type leaseKey struct {
	node string
	id   uint64
}

type resvLease struct {
	node      string
	epoch, id uint64
	renewed   time.Time
	// handed: committed; renewed until the owner took it over (or
	// handedMax renewals, for an owner that never does).
	handed   bool
	renewals int
}

// handedMax bounds the renewals of a committed reservation whose owner
// never takes it over.
const handedMax = 10

func (s *Store) reserveTTL() time.Duration { return s.opts.ReserveTTL }

// reserveRemote reserves n bytes on node and leases the reservation.
func (s *Store) reserveRemote(ctx context.Context, node string, n uint64) (transfer.Reservation, error) {
	r, err := s.opts.Transport.Reserve(ctx, node, n, s.reserveTTL())
	if err != nil {
		return r, err
	}
	s.lease(r)
	return r, nil
}

// lease starts renewing reservation r.
func (s *Store) lease(r transfer.Reservation) {
	s.mu.Lock()
	s.mu.leases[leaseKey{r.Node, r.ID}] = &resvLease{node: r.Node, epoch: r.Epoch, id: r.ID, renewed: s.opts.Now()}
	s.mu.Unlock()
}

// endLease stops renewing reservation id of node (freed, or given up).
func (s *Store) endLease(node string, id uint64) {
	s.mu.Lock()
	delete(s.mu.leases, leaseKey{node, id})
	s.mu.Unlock()
}

// handOver marks reservation id of node committed.
func (s *Store) handOver(node string, id uint64) {
	s.mu.Lock()
	if l := s.mu.leases[leaseKey{node, id}]; l != nil {
		l.handed = true
	}
	s.mu.Unlock()
}

// renewed notes a renewal of reservation id of node made by its writer.
func (s *Store) renewed(node string, id uint64) {
	s.mu.Lock()
	if l := s.mu.leases[leaseKey{node, id}]; l != nil {
		l.renewed = s.opts.Now()
	}
	s.mu.Unlock()
}

// renewLeases renews the leases that passed a third of their TTL. No lock
// is held across the calls.
func (s *Store) renewLeases() {
	now := s.opts.Now()
	ttl := s.reserveTTL()
	s.mu.Lock()
	var due []resvLease
	for _, l := range s.mu.leases {
		if now.Sub(l.renewed) >= ttl/3 {
			due = append(due, *l)
		}
	}
	s.mu.Unlock()
	if len(due) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), ttl/3)
	defer cancel()
	for _, l := range due {
		err := s.opts.Transport.Renew(ctx, l.node, l.epoch, l.id, ttl)
		s.mu.Lock()
		cur := s.mu.leases[leaseKey{l.node, l.id}]
		switch {
		case cur == nil:
		case err == nil:
			cur.renewed = now
			if cur.handed {
				if cur.renewals++; cur.renewals >= handedMax {
					delete(s.mu.leases, leaseKey{l.node, l.id})
				}
			}
		case errors.Is(err, transfer.ErrUnknownReservation), errors.Is(err, transfer.ErrStaleEpoch):
			// Taken over (handed), or lost with its owner: the writer
			// finds out at its next write or commit.
			delete(s.mu.leases, leaseKey{l.node, l.id})
			if !cur.handed {
				s.opts.Logf("reservation %d on node %q lost while its writer was open: %v", l.id, l.node, err)
			}
		default:
			// Unreachable for now: try again next round.
		}
		s.mu.Unlock()
	}
}
