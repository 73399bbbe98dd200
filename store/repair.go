package store

import (
	"context"
	"fmt"
	"slices"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Repair after a node is gone. One daemon of the cluster (the caller
// decides which) runs Reconcile with the set of live nodes: replicas on
// nodes not in it are dropped from every object, and objects with fewer
// replicas than they ask for are copied from a survivor to other live
// nodes. An object with no replica left is lost: it stays in the
// namespace (so the loss is visible), reads fail with ErrLost, and Lost
// lists it. Every change is a compare-and-swap on the object's version, so
// concurrent writers and a second repairer are safe: a conflict skips the
// object until the next round.

// RepairReport says what one Reconcile did.
type RepairReport struct {
	Dropped  int      // replicas removed because their node is gone
	Repaired int      // replicas added to restore replica counts
	Lost     []string // keys with no replica left
	Short    int      // objects still below their replica count
}

// DropNode removes node's replicas from every object (a restarted node's
// memory is new: what the index says it holds is gone).
func (s *Store) DropNode(ctx context.Context, node string) (RepairReport, error) {
	return s.reconcile(ctx, func(n string) bool { return n != node }, false)
}

// Reconcile drops replicas on nodes for which live is false and restores
// replica counts.
func (s *Store) Reconcile(ctx context.Context, live func(node string) bool) (RepairReport, error) {
	return s.reconcile(ctx, live, true)
}

func (s *Store) reconcile(ctx context.Context, live func(string) bool, repair bool) (RepairReport, error) {
	var rep RepairReport
	if repair {
		// Renames whose mover died are finished here (rename.go).
		if err := s.resumeRenames(ctx); err != nil {
			s.opts.Logf("finish renames left under way: %v", err)
		}
	}
	err := s.eachFile(ctx, func(o *Object) error {
		if err := s.reconcileOne(ctx, o, live, repair, &rep); err != nil && ctx.Err() != nil {
			return err
		}
		return nil
	})
	return rep, err
}

// eachFile calls fn for every file with bytes, a page of the index at a
// time, until fn fails.
func (s *Store) eachFile(ctx context.Context, fn func(o *Object) error) error {
	const page = 1000
	for from := ""; ; {
		objs, err := s.idx.Scan(ctx, "", from, page)
		if err != nil {
			return err
		}
		for _, o := range objs {
			if o.Kind != KindFile || o.Size == 0 {
				continue
			}
			if err := fn(o); err != nil {
				return err
			}
		}
		if len(objs) < page {
			return nil
		}
		from = objs[len(objs)-1].Key + "\x00"
	}
}

func (s *Store) reconcileOne(ctx context.Context, o *Object, live func(string) bool, repair bool, rep *RepairReport) error {
	keep := slices.DeleteFunc(slices.Clone(o.Replicas), func(r Replica) bool { return !live(r.Node) })
	dropped := len(o.Replicas) - len(keep)
	want := 1
	if v, ok := o.Xattrs[XattrReplicas]; ok {
		if n, err := ParseReplicas(string(v)); err == nil {
			want = n
		}
	}
	var added []Replica
	var resv []transfer.Reservation
	if repair && len(keep) > 0 && len(keep) < want && s.clustered() {
		have := map[string]bool{}
		for _, r := range keep {
			have[r.Node] = true
		}
		nodes, _ := s.replicaNodes(want-len(keep), have, live)
		for _, node := range nodes {
			reps, rs, err := s.replicateFrom(ctx, keep[0], o.Size, o.Version, []string{node})
			if err != nil {
				s.opts.Logf("repair %q: copy to node %q: %v", o.Key, node, err)
				continue
			}
			added = append(added, reps...)
			resv = append(resv, rs...)
		}
	}
	if dropped == 0 && len(added) == 0 {
		if len(keep) == 0 {
			rep.Lost = append(rep.Lost, o.Key)
		} else if len(keep) < want {
			rep.Short++
		}
		return nil
	}
	next := o.Clone()
	next.Replicas = append(keep, added...)
	var localExt []segment.Extent
	for _, r := range added {
		if s.isLocal(r.Node) {
			localExt = r.Extents
		}
	}
	s.registerBody(localExt)
	_, err := s.idx.CompareAndSwap(ctx, Swap{Key: o.Key, Old: o.Version, New: next})
	if err != nil {
		s.unregisterBody(localExt)
		s.freeReservations(ctx, resv)
		return fmt.Errorf("repair %q: %w", o.Key, err)
	}
	// The copy here is a body like any commit's: a retirement that came
	// in while the swap ran applies now.
	s.mu.Lock()
	s.publishedBodyLocked(next)
	s.mu.Unlock()
	for _, r := range resv {
		s.handOver(r.Node, r.Epoch, r.ID)
	}
	rep.Dropped += dropped
	rep.Repaired += len(added)
	if len(next.Replicas) == 0 {
		rep.Lost = append(rep.Lost, o.Key)
		s.opts.Logf("object %q lost: no surviving replica (its nodes left the cluster)", o.Key)
	} else if len(next.Replicas) < want {
		rep.Short++
	}
	return nil
}

// Lost lists the keys of objects with bytes but no replica.
func (s *Store) Lost(ctx context.Context) ([]string, error) {
	var out []string
	err := s.eachFile(ctx, func(o *Object) error {
		if len(o.Replicas) == 0 {
			out = append(out, o.Key)
		}
		return nil
	})
	return out, err
}
