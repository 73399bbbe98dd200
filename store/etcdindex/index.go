package etcdindex

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/google/btree"
	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// Index is a store.Index kept in etcd and served from a watch-fed cache.
// See the package documentation for its consistency.
type Index struct {
	opts      Options
	cli       *clientv3.Client
	ownClient bool
	objPrefix string         // opts.Prefix + "objects/"
	hub       store.WatchHub // published to under mu, in revision order

	ctx    context.Context // ends at Close; parent of the cache's watch
	cancel context.CancelFunc
	done   chan struct{} // closed when the watch loop has returned

	mu struct {
		sync.Mutex
		tree    *btree.BTreeG[*store.Object]
		bytes   uint64           // MetaBytes of the cached entries
		corrupt map[string]error // keys whose values do not decode
		// files maps a file's inode number to its key (FindIno); internal
		// keys are left out.
		files map[uint64]string
		// rev is the etcd revision the cache reflects: every change at or
		// below it has been applied.
		rev int64
		// readRev is the revision reads must reflect before they answer:
		// this process's last successful swap, or the newest version a
		// failed swap of this process found in etcd.
		readRev  int64
		advanced chan struct{} // closed and replaced whenever rev moves
		watchErr error         // why the cache last fell behind, for messages
		closed   bool
	}
}

var (
	_ store.Index       = (*Index)(nil)
	_ store.EntryFinder = (*Index)(nil)
	_ store.InoFinder   = (*Index)(nil)
)

// New connects to etcd, loads every object under the prefix with one read
// and starts the watch that keeps the cache current. It fails, within
// RequestTimeout, when etcd does not answer.
func New(opts Options) (*Index, error) {
	x, err := open(opts)
	if err != nil {
		return nil, err
	}
	go x.run()
	return x, nil
}

// open is New without starting the watch: the caller must start x.run.
func open(opts Options) (*Index, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	x := &Index{opts: opts, cli: opts.Client, objPrefix: opts.Prefix + "objects/", done: make(chan struct{})}
	if x.cli == nil {
		lg := opts.Logger
		if lg == nil {
			lg = zap.NewNop()
		}
		cli, err := NewClient(opts.Endpoints, opts.DialTimeout, lg)
		if err != nil {
			return nil, fmt.Errorf("etcdindex: connect to %s: %w", strings.Join(opts.Endpoints, ","), err)
		}
		x.cli, x.ownClient = cli, true
	}
	x.ctx, x.cancel = context.WithCancel(context.Background())
	x.mu.tree = newTree()
	x.mu.corrupt = map[string]error{}
	x.mu.files = map[uint64]string{}
	x.mu.advanced = make(chan struct{})
	if err := x.load(); err != nil {
		x.cancel()
		if x.ownClient {
			x.cli.Close()
		}
		return nil, err
	}
	return x, nil
}

func newTree() *btree.BTreeG[*store.Object] {
	return btree.NewG(32, func(a, b *store.Object) bool { return a.Key < b.Key })
}

// Get implements store.Index from the cache.
func (x *Index) Get(ctx context.Context, key string) (*store.Object, error) {
	if err := x.lockCaughtUp(ctx, "get"); err != nil {
		return nil, err
	}
	defer x.mu.Unlock()
	if err := x.mu.corrupt[key]; err != nil {
		return nil, err
	}
	o, ok := x.mu.tree.Get(&store.Object{Key: key})
	if !ok {
		return nil, fmt.Errorf("etcdindex: get %q: %w", key, store.ErrNotFound)
	}
	return o, nil
}

// FindEntry implements store.EntryFinder from the cache: key's object,
// or whether keys lie under it, at one revision.
func (x *Index) FindEntry(ctx context.Context, key string) (*store.Object, bool, error) {
	if err := x.lockCaughtUp(ctx, "get"); err != nil {
		return nil, false, err
	}
	defer x.mu.Unlock()
	if err := x.mu.corrupt[key]; err != nil {
		return nil, false, err
	}
	if o, ok := x.mu.tree.Get(&store.Object{Key: key}); ok {
		return o, false, nil
	}
	kids := false
	x.mu.tree.AscendGreaterOrEqual(&store.Object{Key: key + "/"}, func(o *store.Object) bool {
		kids = strings.HasPrefix(o.Key, key+"/")
		return false
	})
	return nil, kids, nil
}

// Scan implements store.Index from the cache. Keys whose values do not
// decode are left out (Get reports them).
func (x *Index) Scan(ctx context.Context, prefix, from string, limit int) ([]*store.Object, error) {
	if err := x.lockCaughtUp(ctx, "scan"); err != nil {
		return nil, err
	}
	defer x.mu.Unlock()
	from = max(from, prefix)
	var out []*store.Object
	x.mu.tree.AscendGreaterOrEqual(&store.Object{Key: from}, func(o *store.Object) bool {
		if !strings.HasPrefix(o.Key, prefix) {
			return false
		}
		out = append(out, o)
		return limit <= 0 || len(out) < limit
	})
	return out, nil
}

// CompareAndSwap implements store.Index with one etcd transaction: each
// swap compares its key's ModRevision (CreateRevision 0 for Old == 0) and
// puts or deletes it. The version is the transaction's revision.
func (x *Index) CompareAndSwap(ctx context.Context, swaps ...store.Swap) (uint64, error) {
	x.mu.Lock()
	closed := x.mu.closed
	x.mu.Unlock()
	if closed {
		return 0, store.ErrClosed
	}
	if len(swaps) > x.opts.MaxTxnOps {
		return 0, fmt.Errorf("etcdindex: swap of %d keys, more than %d in one etcd transaction: %w",
			len(swaps), x.opts.MaxTxnOps, store.ErrTooLarge)
	}
	seen := make(map[string]bool, len(swaps))
	cmps := make([]clientv3.Cmp, 0, len(swaps))
	ops := make([]clientv3.Op, 0, len(swaps))
	gets := make([]clientv3.Op, 0, len(swaps))
	for _, s := range swaps {
		if seen[s.Key] {
			return 0, fmt.Errorf("etcdindex: swap %q twice in one transaction: %w", s.Key, store.ErrInvalid)
		}
		seen[s.Key] = true
		if s.New != nil && s.New.Key != s.Key {
			return 0, fmt.Errorf("etcdindex: swap %q carries object %q: %w", s.Key, s.New.Key, store.ErrInvalid)
		}
		if s.Old > math.MaxInt64 {
			return 0, fmt.Errorf("etcdindex: swap %q: version %d is no etcd revision: %w", s.Key, s.Old, store.ErrConflict)
		}
		k := x.objPrefix + s.Key
		if s.Old == 0 {
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(k), "=", 0))
		} else {
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(k), "=", int64(s.Old)))
		}
		if s.New == nil {
			ops = append(ops, clientv3.OpDelete(k))
		} else {
			b, err := encode(s.New)
			if err != nil {
				return 0, err
			}
			ops = append(ops, clientv3.OpPut(k, string(b)))
		}
		gets = append(gets, clientv3.OpGet(k, clientv3.WithKeysOnly()))
	}
	rctx, cancel := context.WithTimeout(ctx, x.opts.RequestTimeout)
	defer cancel()
	guards, err := x.guards(rctx, swaps)
	if err != nil {
		return 0, err
	}
	cmps = append(cmps, guards...)
	resp, err := x.cli.Txn(rctx).If(cmps...).Then(ops...).Else(gets...).Commit()
	if err != nil {
		return 0, x.requestError(ctx, fmt.Sprintf("commit %d swaps", len(swaps)), err)
	}
	if !resp.Succeeded {
		return 0, x.conflict(swaps, resp)
	}
	rev := resp.Header.Revision
	wrote := false
	for i, s := range swaps {
		if s.New != nil {
			s.New.Version = uint64(rev)
			wrote = true
		} else if d := resp.Responses[i].GetResponseDeleteRange(); d != nil && d.Deleted > 0 {
			wrote = true
		}
	}
	// A transaction that changed nothing (deleting absent keys) leaves no
	// event in the watch, so the cache may never reach its revision.
	if wrote {
		x.raiseReadRev(rev)
	}
	return uint64(rev), nil
}

// guards returns the compares that make the swaps' InDir and CheckKids
// hold as the transaction lands, from one read of etcd before it (none
// when no swap asks: no read). InDir: the parent directory's object is
// the one read (same CreateRevision), or, for an implicit directory,
// some key is still under it. CheckKids: the keys under the key were
// Kids at the read, and none was made after it. A check that fails at
// the read fails at once (ErrNotFound, ErrConflict); one that fails
// between the read and the transaction fails the transaction, and the
// caller looks again.
func (x *Index) guards(ctx context.Context, swaps []store.Swap) ([]clientv3.Cmp, error) {
	var reads []clientv3.Op
	for _, s := range swaps {
		if p := store.Parent(s.Key); s.InDir && p != "" {
			reads = append(reads, clientv3.OpGet(x.objPrefix+p), clientv3.OpGet(x.objPrefix+p+"/", clientv3.WithPrefix(), clientv3.WithCountOnly()))
		}
		if s.CheckKids {
			reads = append(reads, clientv3.OpGet(x.objPrefix+s.Key+"/", clientv3.WithPrefix(), clientv3.WithCountOnly()))
		}
	}
	if len(reads) == 0 {
		return nil, nil
	}
	resp, err := x.cli.Txn(ctx).Then(reads...).Commit()
	if err != nil {
		return nil, x.requestError(ctx, "read the checks of a swap", err)
	}
	at := resp.Header.Revision
	var cmps []clientv3.Cmp
	r := 0
	next := func() *etcdserverpb.RangeResponse {
		rr := resp.Responses[r].GetResponseRange()
		r++
		return rr
	}
	for _, s := range swaps {
		if p := store.Parent(s.Key); s.InDir && p != "" {
			own, kids := next(), next()
			switch {
			case len(own.Kvs) > 0:
				kv := own.Kvs[0]
				o, err := decode(p, uint64(kv.ModRevision), kv.Value)
				if err != nil {
					return nil, err
				}
				if o.Kind != store.KindDir {
					return nil, fmt.Errorf("etcdindex: swap %q: %q is no directory: %w", s.Key, p, store.ErrNotFound)
				}
				cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(x.objPrefix+p), "=", kv.CreateRevision))
			case kids.Count > 0:
				// Every key under it was made (a range compares each; an
				// empty one compares as a key never made).
				cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(x.objPrefix+p+"/"), ">", 0).WithPrefix())
			default:
				return nil, fmt.Errorf("etcdindex: swap %q: no directory %q: %w", s.Key, p, store.ErrNotFound)
			}
		}
		if s.CheckKids {
			if n := next().Count; n != int64(s.Kids) {
				return nil, fmt.Errorf("etcdindex: swap %q: %d keys under it, want %d: %w", s.Key, n, s.Kids, store.ErrConflict)
			}
			cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(x.objPrefix+s.Key+"/"), "<", at+1).WithPrefix())
		}
	}
	return cmps, nil
}

// conflict explains a failed transaction from its Else reads, and makes
// later reads wait for the versions it found, so that a caller retrying a
// read-modify-write does not spin on a stale cache.
func (x *Index) conflict(swaps []store.Swap, resp *clientv3.TxnResponse) error {
	var why []string
	var newest int64
	for i, s := range swaps {
		var have int64
		if i < len(resp.Responses) {
			if r := resp.Responses[i].GetResponseRange(); r != nil && len(r.Kvs) > 0 {
				have = r.Kvs[0].ModRevision
			}
		}
		newest = max(newest, have)
		if uint64(have) != s.Old {
			why = append(why, fmt.Sprintf("%q: have version %d, want %d", s.Key, have, s.Old))
		}
	}
	x.raiseReadRev(newest)
	if len(why) == 0 {
		// The key changed back and forth between compare and read; rare.
		why = append(why, fmt.Sprintf("%d keys", len(swaps)))
	}
	return fmt.Errorf("etcdindex: swap %s: %w", strings.Join(why, ", "), store.ErrConflict)
}

func (x *Index) raiseReadRev(rev int64) {
	x.mu.Lock()
	x.mu.readRev = max(x.mu.readRev, rev)
	x.mu.Unlock()
}

// requestError wraps an error of an etcd request.
func (x *Index) requestError(ctx context.Context, op string, err error) error {
	x.mu.Lock()
	closed := x.mu.closed
	x.mu.Unlock()
	switch {
	case closed:
		return fmt.Errorf("etcdindex: %s: %w", op, store.ErrClosed)
	case errors.Is(err, rpctypes.ErrTooManyOps), errors.Is(err, rpctypes.ErrRequestTooLarge):
		return fmt.Errorf("etcdindex: %s: %v: %w", op, err, store.ErrTooLarge)
	case ctx.Err() != nil:
		return fmt.Errorf("etcdindex: %s: %w", op, err) // the caller gave up
	}
	return fmt.Errorf("etcdindex: %s: etcd unavailable at %s: %w: %w", op, strings.Join(x.cli.Endpoints(), ","), store.ErrUnavailable, err)
}

// lockCaughtUp locks x.mu once the cache reflects readRev, waiting at most
// RequestTimeout: past it, etcd's watch has not delivered this node's own
// write, and the error is a request's (requestError: store.ErrUnavailable
// unless the caller gave up first). On error x.mu is not held.
func (x *Index) lockCaughtUp(parent context.Context, op string) error {
	x.mu.Lock()
	if x.mu.closed {
		x.mu.Unlock()
		return store.ErrClosed
	}
	if x.mu.rev >= x.mu.readRev {
		return nil
	}
	want := x.mu.readRev
	x.mu.Unlock()
	ctx, cancel := context.WithTimeout(parent, x.opts.RequestTimeout)
	defer cancel()
	for {
		x.mu.Lock()
		if x.mu.closed {
			x.mu.Unlock()
			return store.ErrClosed
		}
		if x.mu.rev >= want {
			return nil
		}
		have, werr, ch := x.mu.rev, x.mu.watchErr, x.mu.advanced
		x.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return x.requestError(parent, op, fmt.Errorf("cache at revision %d has not reached this node's write at %d (last watch error: %v): %w",
				have, want, werr, ctx.Err()))
		}
	}
}

// advanceLocked moves the cache revision forward and wakes waiters.
func (x *Index) advanceLocked(rev int64) {
	if rev <= x.mu.rev {
		return
	}
	x.mu.rev = rev
	x.mu.watchErr = nil
	close(x.mu.advanced)
	x.mu.advanced = make(chan struct{})
}

// Watch implements store.Index. Events come from the cache, in the order
// the cache applies them (etcd commit order); the first is the first change
// after this process's own last write. Events are queued per watcher
// without bound, so a slow reader never holds up the cache.
func (x *Index) Watch(ctx context.Context, prefix string) (<-chan store.Event, error) {
	if err := x.lockCaughtUp(ctx, "watch"); err != nil {
		return nil, err
	}
	defer x.mu.Unlock()
	return x.hub.Watch(ctx, prefix)
}

// Close implements store.Index: it ends every watch, stops the cache's
// etcd watch and closes the client if New made it.
func (x *Index) Close() error {
	x.mu.Lock()
	if x.mu.closed {
		x.mu.Unlock()
		return nil
	}
	x.mu.closed = true
	x.hub.Close()
	close(x.mu.advanced)
	x.mu.Unlock()
	x.cancel()
	<-x.done
	if x.ownClient {
		if err := x.cli.Close(); err != nil && !errors.Is(err, context.Canceled) {
			return fmt.Errorf("etcdindex: close client: %w", err)
		}
	}
	return nil
}

// load replaces the cache with one read of the whole prefix. Watchers get
// the difference between the old and new cache as events.
func (x *Index) load() error {
	ctx, cancel := context.WithTimeout(x.ctx, x.opts.RequestTimeout)
	defer cancel()
	resp, err := x.cli.Get(ctx, x.objPrefix, clientv3.WithPrefix())
	if err != nil {
		return x.requestError(x.ctx, "load "+x.objPrefix, err)
	}
	tree := newTree()
	corrupt := map[string]error{}
	files := map[uint64]string{}
	var bytes uint64
	for _, kv := range resp.Kvs {
		key := string(kv.Key[len(x.objPrefix):])
		o, err := decode(key, uint64(kv.ModRevision), kv.Value)
		if err != nil {
			corrupt[key] = err
			continue
		}
		tree.ReplaceOrInsert(o)
		bytes += o.MetaBytes()
		if indexedFile(o) {
			files[o.Ino] = o.Key
		}
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.mu.closed {
		return store.ErrClosed
	}
	// The difference stands in for lost commits: deliver it as one.
	d := diff(x.mu.tree, tree)
	for i := range d {
		d[i].Rev = uint64(resp.Header.Revision)
	}
	x.sendLocked(d)
	x.mu.tree, x.mu.corrupt, x.mu.files, x.mu.bytes = tree, corrupt, files, bytes
	x.advanceLocked(resp.Header.Revision)
	return nil
}

// diff returns the events that turn old into new: deletes, then puts in
// version order. It stands in for the changes a compacted watch lost.
func diff(old, new *btree.BTreeG[*store.Object]) []store.Event {
	var dels, puts []store.Event
	old.Ascend(func(o *store.Object) bool {
		if _, ok := new.Get(o); !ok {
			dels = append(dels, store.Event{Type: store.EventDelete, Object: o})
		}
		return true
	})
	new.Ascend(func(o *store.Object) bool {
		if p, ok := old.Get(o); !ok || p.Version != o.Version {
			puts = append(puts, store.Event{Type: store.EventPut, Object: o})
		}
		return true
	})
	slicesSortByVersion(puts)
	return append(dels, puts...)
}

// run keeps the cache current until Close: it watches from the revision
// after the cache's, and reloads when the watch fails (compaction, lost
// leader, cancellation).
func (x *Index) run() {
	defer close(x.done)
	backoff := 50 * time.Millisecond
	for {
		x.mu.Lock()
		rev := x.mu.rev
		x.mu.Unlock()
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(x.ctx))
		wch := x.cli.Watch(wctx, x.objPrefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1))
		err := x.follow(wch)
		cancel()
		if x.ctx.Err() != nil {
			return
		}
		x.mu.Lock()
		x.mu.watchErr = err
		x.mu.Unlock()
		for {
			err := x.load()
			if err == nil || x.ctx.Err() != nil {
				backoff = 50 * time.Millisecond
				break
			}
			x.mu.Lock()
			x.mu.watchErr = err
			x.mu.Unlock()
			select {
			case <-time.After(backoff):
			case <-x.ctx.Done():
				return
			}
			backoff = min(2*backoff, 2*time.Second)
		}
	}
}

var errWatchClosed = errors.New("etcdindex: watch channel closed")

// follow applies watch responses to the cache until the watch fails.
func (x *Index) follow(wch clientv3.WatchChan) error {
	for resp := range wch {
		if err := resp.Err(); err != nil {
			return err
		}
		x.mu.Lock()
		if x.mu.closed {
			x.mu.Unlock()
			return store.ErrClosed
		}
		if resp.IsProgressNotify() {
			x.advanceLocked(resp.Header.Revision)
		} else {
			x.applyLocked(resp.Events)
		}
		x.mu.Unlock()
	}
	return errWatchClosed
}

// applyLocked applies watch events to the cache and passes them on. etcd
// keeps the events of one revision in one response, so the cache never
// shows half a transaction.
func (x *Index) applyLocked(evs []*clientv3.Event) {
	out := make([]store.Event, 0, len(evs))
	var last int64
	for _, ev := range evs {
		k := string(ev.Kv.Key)
		if !strings.HasPrefix(k, x.objPrefix) {
			continue
		}
		key := k[len(x.objPrefix):]
		rev := ev.Kv.ModRevision
		last = max(last, rev)
		prev, had := x.mu.tree.Get(&store.Object{Key: key})
		delete(x.mu.corrupt, key)
		if ev.Type == clientv3.EventTypePut {
			o, err := decode(key, uint64(rev), ev.Kv.Value)
			if err == nil {
				if had {
					x.mu.bytes -= prev.MetaBytes()
					x.forgetFileLocked(prev)
				}
				x.mu.tree.ReplaceOrInsert(o)
				if indexedFile(o) {
					x.mu.files[o.Ino] = key
				}
				x.mu.bytes += o.MetaBytes()
				out = append(out, store.Event{Type: store.EventPut, Object: o, Rev: uint64(rev)})
				continue
			}
			x.mu.corrupt[key] = err
		}
		// A delete, or a put this version cannot read: the object is gone.
		if had {
			x.mu.bytes -= prev.MetaBytes()
			x.forgetFileLocked(prev)
			x.mu.tree.Delete(prev)
			out = append(out, store.Event{Type: store.EventDelete, Object: prev, Rev: uint64(rev)})
		}
	}
	x.sendLocked(out)
	x.advanceLocked(last)
}

// indexedFile says whether FindIno answers for o.
func indexedFile(o *store.Object) bool { return o.Kind == store.KindFile && !store.IsInternal(o.Key) }

// forgetFileLocked drops o's entry in files, unless another key took its
// inode number since (a rename's new key applied before its old one
// left).
func (x *Index) forgetFileLocked(o *store.Object) {
	if k, ok := x.mu.files[o.Ino]; ok && k == o.Key {
		delete(x.mu.files, o.Ino)
	}
}

// FindIno implements store.InoFinder from the cache.
func (x *Index) FindIno(ctx context.Context, ino uint64) (string, bool, error) {
	if err := x.lockCaughtUp(ctx, "find inode"); err != nil {
		return "", false, err
	}
	defer x.mu.Unlock()
	key, ok := x.mu.files[ino]
	return key, ok, nil
}

// MetaBytes implements store.MetaSizer: the cache's entries.
func (x *Index) MetaBytes() uint64 {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.mu.bytes
}

func (x *Index) sendLocked(events []store.Event) {
	if len(events) == 0 {
		return
	}
	x.hub.Publish(events)
}

// slicesSortByVersion orders events by object version, keeping the order
// of equal versions.
func slicesSortByVersion(events []store.Event) {
	slices.SortStableFunc(events, func(a, b store.Event) int {
		switch {
		case a.Object.Version < b.Object.Version:
			return -1
		case a.Object.Version > b.Object.Version:
			return 1
		}
		return 0
	})
}

var _ store.SwapLimiter = (*Index)(nil)

// MaxSwaps implements store.SwapLimiter: one etcd transaction carries at
// most MaxTxnOps compares and as many operations.
func (x *Index) MaxSwaps() int { return x.opts.MaxTxnOps }
