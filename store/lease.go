package store

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Writer side of remote reservations. Every reservation this node holds
// on another node, for a draft's bytes or a replica being copied, is a
// lease here from the Reserve that made it until it is given back (freed)
// or handed over (committed: the owner takes the extents over when its
// follow loop sees the commit). The renew loop renews leases every third
// of Options.ReserveTTL, each node's in parallel with the others' and
// each call bounded, so a reservation lives as long as its writer,
// however slow, and one unreachable node delays no other's renewals. The
// owner refuses writes outside live reservations (transfer.WriteGuard),
// so a write that outlived its reservation (its writer was cut off)
// fails instead of landing in memory given to another object. A
// handed-over lease is renewed until the owner no longer knows it (it
// consumed the reservation), for handedMax attempts at most, which covers
// an owner that sees the commit late. A lease on a node that left the
// cluster ends. Guarded by Store.mu.

// DefaultReserveTTL is Options.ReserveTTL's default.
const DefaultReserveTTL = 30 * time.Second

// leaseKey names a reservation: ids restart with the owner's daemon, so
// its epoch is part of the name.
type leaseKey struct {
	node      string
	epoch, id uint64
}

type resvLease struct {
	leaseKey
	renewed time.Time
	// handed: committed; renewed until the owner took it over, at most
	// handedMax attempts.
	handed   bool
	attempts int
}

// handedMax bounds the renewals of a committed reservation whose owner
// never takes it over.
const handedMax = 10

func (s *Store) reserveTTL() time.Duration { return s.opts.ReserveTTL }

// reserveRemote reserves n bytes on node and leases the reservation.
func (s *Store) reserveRemote(ctx context.Context, node string, n uint64) (transfer.Reservation, error) {
	r, err := s.opts.Transport.Reserve(ctx, node, n, s.reserveTTL())
	if err != nil {
		return r, reserveError(err)
	}
	s.mu.Lock()
	k := leaseKey{r.Node, r.Epoch, r.ID}
	s.mu.leases[k] = &resvLease{leaseKey: k, renewed: s.opts.Now()}
	s.mu.Unlock()
	return r, nil
}

// reserveRemoteOrLess reserves want bytes on node, or failing that least
// (no more than want). A refusal of want is asked again for least even
// when the owner refused for want of its index (ErrUnavailable): it
// evicts only for what its free room does not hold, so least may fit at
// once, and a write that fits must not fail for etcd's absence.
func (s *Store) reserveRemoteOrLess(ctx context.Context, node string, want, least uint64) (transfer.Reservation, error) {
	r, err := s.reserveRemote(ctx, node, want)
	if err != nil && want > least {
		r, err = s.reserveRemote(ctx, node, least)
	}
	return r, err
}

// reserveError adds the store's sentinel to an owner's refusal of a
// reservation: ErrNoSpace for no room, ErrUnavailable for no room while
// its index does not answer.
func reserveError(err error) error {
	switch {
	case errors.Is(err, transfer.ErrIndexUnavailable):
		return errors.Join(ErrUnavailable, err)
	case errors.Is(err, transfer.ErrNoSpace):
		return errors.Join(ErrNoSpace, err)
	}
	return err
}

// endLease stops renewing reservation id of node's daemon epoch (freed, or
// given up).
func (s *Store) endLease(node string, epoch, id uint64) {
	s.mu.Lock()
	delete(s.mu.leases, leaseKey{node, epoch, id})
	s.mu.Unlock()
}

// handOver marks a reservation committed.
func (s *Store) handOver(node string, epoch, id uint64) {
	s.mu.Lock()
	if l := s.mu.leases[leaseKey{node, epoch, id}]; l != nil {
		l.handed = true
	}
	s.mu.Unlock()
}

// renewed notes a renewal of a reservation made by its writer.
func (s *Store) renewed(node string, epoch, id uint64) {
	s.mu.Lock()
	if l := s.mu.leases[leaseKey{node, epoch, id}]; l != nil {
		l.renewed = s.opts.Now()
	}
	s.mu.Unlock()
}

// renewLoop renews leases and the holds of this node's open readers, on
// its own goroutine: calls to a slow node never delay the reaper.
func (s *Store) renewLoop() {
	defer s.wg.Done()
	t := time.NewTicker(min(time.Second, s.reserveTTL()/6))
	defer t.Stop()
	renewed := s.opts.Now()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
			s.renewLeases()
			if now := s.opts.Now(); now.Sub(renewed) >= HoldTTL/3 {
				renewed = now
				s.renewHolds()
			}
		}
	}
}

// renewLeases renews the leases that passed a third of their TTL: one
// goroutine per node, each call bounded by a third of the TTL. No lock is
// held across the calls.
func (s *Store) renewLeases() {
	now := s.opts.Now()
	ttl := s.reserveTTL()
	var members map[string]bool
	if s.opts.Cluster != nil {
		members = map[string]bool{}
		for _, n := range s.opts.Cluster.Nodes() {
			members[n.Name] = true
		}
	}
	byNode := map[string][]leaseKey{}
	s.mu.Lock()
	for k, l := range s.mu.leases {
		switch {
		case members != nil && !members[k.node]:
			delete(s.mu.leases, k) // gone from the cluster, and its memory with it
		case now.Sub(l.renewed) >= ttl/3:
			if l.handed {
				if l.attempts++; l.attempts > handedMax {
					delete(s.mu.leases, k)
					continue
				}
			}
			byNode[k.node] = append(byNode[k.node], k)
		}
	}
	s.mu.Unlock()
	var wg sync.WaitGroup
	for _, keys := range byNode {
		wg.Go(func() {
			for _, k := range keys {
				ctx, cancel := context.WithTimeout(context.Background(), ttl/3)
				err := s.opts.Transport.Renew(ctx, k.node, k.epoch, k.id, ttl)
				cancel()
				s.leaseRenewed(k, now, err)
				if err != nil && !errors.Is(err, transfer.ErrUnknownReservation) && !errors.Is(err, transfer.ErrStaleEpoch) {
					return // the node does not answer: the next round tries again
				}
			}
		})
	}
	wg.Wait()
}

// leaseRenewed records the outcome of one renewal.
func (s *Store) leaseRenewed(k leaseKey, at time.Time, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.mu.leases[k]
	switch {
	case l == nil:
	case err == nil:
		l.renewed = at
	case errors.Is(err, transfer.ErrUnknownReservation), errors.Is(err, transfer.ErrStaleEpoch):
		// Taken over (handed), or lost with its owner: the writer finds
		// out at its next write or commit.
		delete(s.mu.leases, k)
		if !l.handed {
			s.opts.Logf("reservation %d on node %q lost while its writer was open: %v", k.id, k.node, err)
		}
	}
}
