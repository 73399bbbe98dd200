package etcdindex

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// Membership: every daemon registers a Node at Prefix+"nodes/"+Name under
// an etcd lease that it keeps alive. The key lives exactly as long as the
// lease: Leave revokes it (the key goes at once); a daemon that dies or is
// cut off stops refreshing it and etcd deletes the key after the TTL. Every
// member keeps a watch-fed cache of all node keys (Nodes) and reports
// changes as MemberEvents (Watch), so a node's death reaches the store as a
// Left event whichever way it happened.
//
// Locks: Membership.mu guards the cache, the registration state and the
// watcher list; a watch queue's lock is taken under it, never the
// other way round. No lock is held across an etcd call.

// ErrNameTaken reports a Join under a name another live node holds.
var ErrNameTaken = errors.New("etcdindex: node name taken")

// MemberOptions configures Join. The zero value of each field means its
// default.
type MemberOptions struct {
	// Prefix is the same prefix as Options.Prefix; nodes live under
	// Prefix+"nodes/". "" means "/mooncake/".
	Prefix string
	// TTL is the lease: how long after its last keepalive a node counts
	// as dead. etcd counts whole seconds, so it is rounded up. 0 means 5s.
	TTL time.Duration
	// UpdateEvery is the least time between two writes of this node's
	// entry caused by Update; updates in between are coalesced, the last
	// one wins. 0 means 1s.
	UpdateEvery time.Duration
	// RequestTimeout bounds every etcd request made in the background. 0
	// means 5s. Join's own requests are bounded by its ctx as well.
	RequestTimeout time.Duration
}

// DefaultMemberOptions returns the options Join uses for zero fields.
func DefaultMemberOptions() MemberOptions {
	return MemberOptions{Prefix: "/mooncake/", TTL: 5 * time.Second, UpdateEvery: time.Second, RequestTimeout: 5 * time.Second}
}

func (o MemberOptions) withDefaults() MemberOptions {
	d := DefaultMemberOptions()
	if o.Prefix == "" {
		o.Prefix = d.Prefix
	}
	if o.TTL == 0 {
		o.TTL = d.TTL
	}
	if o.UpdateEvery == 0 {
		o.UpdateEvery = d.UpdateEvery
	}
	if o.RequestTimeout == 0 {
		o.RequestTimeout = d.RequestTimeout
	}
	return o
}

// Validate reports every bad field at once.
func (o MemberOptions) Validate() error {
	var errs []error
	if o.TTL < 0 {
		errs = append(errs, fmt.Errorf("etcdindex: TTL %v < 0", o.TTL))
	}
	if o.UpdateEvery < 0 {
		errs = append(errs, fmt.Errorf("etcdindex: UpdateEvery %v < 0", o.UpdateEvery))
	}
	if o.RequestTimeout < 0 {
		errs = append(errs, fmt.Errorf("etcdindex: RequestTimeout %v < 0", o.RequestTimeout))
	}
	return errors.Join(errs...)
}

// MemberEventType says what happened to a node.
type MemberEventType int

const (
	// Joined: a node key appeared (a join, or a re-join after the node's
	// lease was lost).
	Joined MemberEventType = iota + 1
	// Updated: a live node rewrote its entry (Update).
	Updated
	// Left: the node key is gone, by Leave or because its lease expired.
	// Node is the last entry seen.
	Left
)

func (t MemberEventType) String() string {
	switch t {
	case Joined:
		return "joined"
	case Updated:
		return "updated"
	case Left:
		return "left"
	}
	return fmt.Sprintf("MemberEventType(%d)", int(t))
}

// MemberEvent is one change of the node set.
type MemberEvent struct {
	Type MemberEventType
	Node Node
}

// Membership is this daemon's registration and its view of all nodes.
// It is safe for concurrent use.
type Membership struct {
	cli      *clientv3.Client
	opts     MemberOptions
	ttlSec   int64
	prefix   string // opts.Prefix + "nodes/"
	key      string // prefix + self name
	name     string
	ctx      context.Context // ends at Close
	cancel   context.CancelFunc
	done     chan struct{} // closed when both loops have returned
	updateCh chan struct{} // 1-buffered: Update has news for the keeper

	mu struct {
		sync.Mutex
		self     Node
		dirty    bool // self changed since it was last written
		lease    clientv3.LeaseID
		live     bool
		err      error // why not live, for Err
		nodes    map[string]Node
		watchers map[*store.Queue[MemberEvent]]struct{}
		closed   bool
	}
}

// Join registers self under a new lease of opts.TTL and keeps it alive
// until Leave or Close; then it loads and starts watching all nodes. The
// caller keeps owning cli and must close it after the Membership.
//
// It fails with an error wrapping ErrNameTaken when a live node holds
// self.Name, store.ErrInvalid for a node that cannot be encoded, and
// within ctx (and RequestTimeout) when etcd does not answer. When Join
// returns, Nodes includes self.
func Join(ctx context.Context, cli *clientv3.Client, self Node, opts MemberOptions) (*Membership, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	if self.Started.IsZero() {
		self.Started = time.Now()
	}
	self.Started = self.Started.UTC()
	if _, err := encodeNode(&self); err != nil {
		return nil, fmt.Errorf("etcdindex: join: %w", err)
	}
	m := &Membership{
		cli:      cli,
		opts:     opts,
		ttlSec:   int64((opts.TTL + time.Second - 1) / time.Second),
		prefix:   opts.Prefix + "nodes/",
		name:     self.Name,
		done:     make(chan struct{}),
		updateCh: make(chan struct{}, 1),
	}
	m.key = m.prefix + self.Name
	m.mu.self = self
	m.mu.nodes = map[string]Node{}
	m.mu.watchers = map[*store.Queue[MemberEvent]]struct{}{}
	m.ctx, m.cancel = context.WithCancel(context.Background())

	ka, err := m.register(ctx, true)
	if err != nil {
		m.cancel()
		return nil, err
	}
	rev, err := m.load(ctx)
	if err != nil {
		m.cancel() // stops the keepalive; the lease expires
		m.revoke()
		return nil, err
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); m.keep(ka) }()
	go func() { defer wg.Done(); m.follow(rev) }()
	go func() { wg.Wait(); close(m.done) }()
	return m, nil
}

// Name is this node's name.
func (m *Membership) Name() string { return m.name }

// Live reports whether this node's entry is registered under a lease that
// is being kept alive. It turns false when keepalives stop being answered
// for a TTL (etcd away) or the lease is lost, and true again when the
// Membership has re-registered; meanwhile other nodes may have seen this
// node leave and re-join.
func (m *Membership) Live() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mu.live
}

// Err says why the node is not live (nil when it is): the last error of
// keeping or re-registering it, for example ErrNameTaken when another node
// took the name while this one was away.
func (m *Membership) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mu.live {
		return nil
	}
	return m.mu.err
}

// Nodes returns every registered node from the cache, this one included,
// ordered by name. While etcd is away it is the last view.
func (m *Membership) Nodes() []Node {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := slices.Collect(maps.Values(m.mu.nodes))
	slices.SortFunc(out, func(a, b Node) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// Update replaces this node's entry (Used, Free, Segments ...); Name must
// stay the same and a zero Started keeps the old one. The write happens in
// the background, at most once per UpdateEvery, and is retried while etcd
// is away; Update itself does not block on etcd.
func (m *Membership) Update(node Node) error {
	if node.Name != m.name {
		return fmt.Errorf("etcdindex: update node %q as %q: %w", m.name, node.Name, store.ErrInvalid)
	}
	m.mu.Lock()
	if node.Started.IsZero() {
		node.Started = m.mu.self.Started
	}
	node.Started = node.Started.UTC()
	m.mu.Unlock()
	if _, err := encodeNode(&node); err != nil {
		return err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mu.closed {
		return fmt.Errorf("etcdindex: update node %q: %w", m.name, store.ErrClosed)
	}
	m.mu.self, m.mu.dirty = node, true
	select {
	case m.updateCh <- struct{}{}:
	default:
	}
	return nil
}

// Watch reports node changes until ctx ends or the Membership closes; then
// the channel is closed. It starts with a Joined event for every node in
// the cache, so a reader builds its view from events alone. Events are
// queued without bound: a slow reader never holds up the cache.
func (m *Membership) Watch(ctx context.Context) (<-chan MemberEvent, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mu.closed {
		return nil, fmt.Errorf("etcdindex: watch nodes: %w", store.ErrClosed)
	}
	w := store.NewQueue[MemberEvent]()
	var initial []MemberEvent
	for _, n := range m.mu.nodes {
		initial = append(initial, MemberEvent{Type: Joined, Node: n})
	}
	slices.SortFunc(initial, func(a, b MemberEvent) int { return strings.Compare(a.Node.Name, b.Node.Name) })
	w.Send(initial...)
	m.mu.watchers[w] = struct{}{}
	go func() {
		select {
		case <-ctx.Done():
		case <-w.Done():
		}
		m.mu.Lock()
		delete(m.mu.watchers, w)
		m.mu.Unlock()
		w.Stop()
	}()
	go w.Run(ctx)
	return w.Out(), nil
}

// Leave closes the Membership and revokes its lease, so that every member
// sees this node leave at once; after Close it still revokes. If etcd does not answer within
// RequestTimeout it returns that error; the lease then expires by itself.
func (m *Membership) Leave() error {
	m.Close()
	return m.revoke()
}

// Close stops keeping the lease alive and watching, without revoking the
// lease: the node's entry stays until the TTL runs out, as if the daemon
// had died. It does not close the client.
func (m *Membership) Close() error {
	m.mu.Lock()
	if m.mu.closed {
		m.mu.Unlock()
		return nil
	}
	m.mu.closed = true
	m.mu.live = false
	m.mu.err = store.ErrClosed
	for w := range m.mu.watchers {
		w.Stop()
	}
	m.mu.watchers = nil
	m.mu.Unlock()
	m.cancel()
	<-m.done
	return nil
}

func (m *Membership) revoke() error {
	m.mu.Lock()
	lease := m.mu.lease
	m.mu.Unlock()
	if lease == clientv3.NoLease {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), m.opts.RequestTimeout)
	defer cancel()
	if _, err := m.cli.Revoke(ctx, lease); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return m.requestError(fmt.Sprintf("leave as %q: revoke lease %x", m.name, lease), err)
	}
	return nil
}

func (m *Membership) requestError(op string, err error) error {
	return fmt.Errorf("etcdindex: %s: etcd unavailable at %s: %w: %w", op, strings.Join(m.cli.Endpoints(), ","), store.ErrUnavailable, err)
}

// register makes this node's key live: it keeps the current lease if etcd
// still has it, grants a new one otherwise, writes the entry under it and
// starts the keepalive. At Join (first), a name held by someone else
// fails with ErrNameTaken; later it does as well, and keep retries.
func (m *Membership) register(ctx context.Context, first bool) (keepalive, error) {
	ctx, cancel := context.WithTimeout(ctx, m.opts.RequestTimeout)
	defer cancel()
	m.mu.Lock()
	lease := m.mu.lease
	self := m.mu.self
	m.mu.dirty = false
	m.mu.Unlock()
	val, err := encodeNode(&self)
	if err != nil {
		return keepalive{}, err // Join and Update checked it
	}
	op := fmt.Sprintf("join as %q", m.name)
	if lease != clientv3.NoLease {
		if _, err := m.cli.KeepAliveOnce(ctx, lease); errors.Is(err, rpctypes.ErrLeaseNotFound) {
			lease = clientv3.NoLease
		} else if err != nil {
			return keepalive{}, m.requestError(op+": keep lease alive", err)
		}
	}
	granted := false
	if lease == clientv3.NoLease {
		g, err := m.cli.Grant(ctx, m.ttlSec)
		if err != nil {
			return keepalive{}, m.requestError(op+": grant lease", err)
		}
		lease, granted = g.ID, true
	}
	// The key is ours to write when it is absent, or when it is under our
	// own lease (a lease that outlived an outage keeps its key).
	put := clientv3.OpPut(m.key, string(val), clientv3.WithLease(lease))
	resp, err := m.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(m.key), "=", 0)).
		Then(put).
		Else(clientv3.OpGet(m.key)).Commit()
	if err == nil && !resp.Succeeded {
		kvs := resp.Responses[0].GetResponseRange().Kvs
		if len(kvs) == 1 && clientv3.LeaseID(kvs[0].Lease) == lease {
			resp, err = m.cli.Txn(ctx).
				If(clientv3.Compare(clientv3.LeaseValue(m.key), "=", lease)).
				Then(put).Commit()
			if err == nil && !resp.Succeeded {
				err = fmt.Errorf("etcdindex: %s: key changed during registration: %w", op, ErrNameTaken)
			}
		} else {
			holder := "unreadable entry"
			if len(kvs) == 1 {
				if n, derr := decodeNode(kvs[0].Value); derr == nil {
					holder = fmt.Sprintf("at %s since %s", n.Addr, n.Started.Format(time.RFC3339))
				}
			}
			err = fmt.Errorf("etcdindex: %s: a live node holds the name (%s): %w", op, holder, ErrNameTaken)
		}
	} else if err != nil {
		err = m.requestError(op+": put node", err)
	}
	if err != nil {
		if granted && first {
			// Nobody will keep it alive; do not leave it to expire.
			rctx, rcancel := context.WithTimeout(context.Background(), m.opts.RequestTimeout)
			m.cli.Revoke(rctx, lease)
			rcancel()
		}
		m.mu.Lock()
		m.mu.dirty = true
		if granted {
			m.mu.lease = lease
		}
		m.mu.Unlock()
		return keepalive{}, err
	}
	// The keepalive lives with the Membership, not with ctx.
	kctx, kcancel := context.WithCancel(m.ctx)
	ch, err := m.cli.KeepAlive(kctx, lease)
	if err != nil {
		kcancel()
		return keepalive{}, fmt.Errorf("etcdindex: %s: keep lease alive: %w", op, err)
	}
	m.mu.Lock()
	m.mu.lease, m.mu.live, m.mu.err = lease, true, nil
	m.mu.Unlock()
	return keepalive{ch, kcancel}, nil
}

// keepalive is the client's keepalive of one lease; stop ends it, so that
// a lease this Membership moved away from is no longer renewed.
type keepalive struct {
	ch   <-chan *clientv3.LeaseKeepAliveResponse
	stop context.CancelFunc
}

// keep drains the keepalive, writes updates and re-registers when the
// lease stops being kept alive, until Close.
func (m *Membership) keep(ka keepalive) {
	defer func() {
		if ka.stop != nil {
			ka.stop()
		}
	}()
	var last time.Time // last write of the entry
	timer := time.NewTimer(0)
	<-timer.C
	armed := false
	arm := func(d time.Duration) {
		if !armed {
			timer.Reset(d)
			armed = true
		}
	}
	defer timer.Stop()
	backoff := 100 * time.Millisecond
	for {
		if ka.ch == nil {
			var err error
			ka, err = m.register(m.ctx, false)
			if m.ctx.Err() != nil {
				return
			}
			if err != nil {
				m.mu.Lock()
				m.mu.err = err
				m.mu.Unlock()
				select {
				case <-time.After(backoff):
				case <-m.ctx.Done():
					return
				}
				backoff = min(2*backoff, 2*time.Second)
				continue
			}
			backoff = 100 * time.Millisecond
			last = time.Now()
		}
		select {
		case <-m.ctx.Done():
			return
		case _, ok := <-ka.ch:
			if !ok {
				// The lease expired, or etcd did not answer for a TTL.
				m.mu.Lock()
				m.mu.live = false
				m.mu.err = fmt.Errorf("etcdindex: node %q: lease lost or not renewed for %v (etcd at %s)",
					m.name, m.opts.TTL, strings.Join(m.cli.Endpoints(), ","))
				m.mu.Unlock()
				ka.stop()
				ka = keepalive{}
			}
			continue
		case <-m.updateCh:
		case <-timer.C:
			armed = false
		}
		m.mu.Lock()
		dirty := m.mu.dirty
		m.mu.Unlock()
		if !dirty {
			continue
		}
		if wait := m.opts.UpdateEvery - time.Since(last); wait > 0 {
			arm(wait)
			continue
		}
		last = time.Now()
		if lost := m.write(); lost {
			ka.stop()
			ka = keepalive{}
		} else {
			m.mu.Lock()
			dirty = m.mu.dirty
			m.mu.Unlock()
			if dirty { // failed, or a newer update came in
				arm(m.opts.UpdateEvery)
			}
		}
	}
}

// write puts the current entry under the current lease. It reports true
// when the key is no longer under that lease, so the caller re-registers.
func (m *Membership) write() (lost bool) {
	m.mu.Lock()
	self, lease := m.mu.self, m.mu.lease
	m.mu.dirty = false
	m.mu.Unlock()
	val, err := encodeNode(&self)
	if err != nil {
		return false // Update checked it
	}
	ctx, cancel := context.WithTimeout(m.ctx, m.opts.RequestTimeout)
	defer cancel()
	resp, err := m.cli.Txn(ctx).
		If(clientv3.Compare(clientv3.LeaseValue(m.key), "=", lease), clientv3.Compare(clientv3.CreateRevision(m.key), ">", 0)).
		Then(clientv3.OpPut(m.key, string(val), clientv3.WithLease(lease))).Commit()
	if err != nil || !resp.Succeeded {
		m.mu.Lock()
		m.mu.dirty = true
		if err != nil {
			m.mu.err = m.requestError(fmt.Sprintf("update node %q", m.name), err)
		} else {
			m.mu.live = false
			m.mu.err = fmt.Errorf("etcdindex: update node %q: entry is no longer under lease %x", m.name, lease)
		}
		m.mu.Unlock()
		return err == nil
	}
	return false
}

// load replaces the cache with one read of all nodes and publishes the
// difference. It returns the revision read.
func (m *Membership) load(ctx context.Context) (int64, error) {
	ctx, cancel := context.WithTimeout(ctx, m.opts.RequestTimeout)
	defer cancel()
	resp, err := m.cli.Get(ctx, m.prefix, clientv3.WithPrefix())
	if err != nil {
		return 0, m.requestError("load "+m.prefix, err)
	}
	nodes := map[string]Node{}
	for _, kv := range resp.Kvs {
		if n, ok := m.decodeKV(kv.Key, kv.Value); ok {
			nodes[n.Name] = n
		}
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	var evs []MemberEvent
	for name, n := range m.mu.nodes {
		if _, ok := nodes[name]; !ok {
			evs = append(evs, MemberEvent{Type: Left, Node: n})
		}
	}
	for name, n := range nodes {
		if old, ok := m.mu.nodes[name]; !ok {
			evs = append(evs, MemberEvent{Type: Joined, Node: n})
		} else if !nodeEqual(old, n) {
			evs = append(evs, MemberEvent{Type: Updated, Node: n})
		}
	}
	m.mu.nodes = nodes
	m.publishLocked(evs)
	return resp.Header.Revision, nil
}

// decodeKV returns the node of a key under the prefix; entries that do not
// decode, or whose name is not their key's, are left out.
func (m *Membership) decodeKV(key, val []byte) (Node, bool) {
	name, ok := strings.CutPrefix(string(key), m.prefix)
	if !ok {
		return Node{}, false
	}
	n, err := decodeNode(val)
	if err != nil || n.Name != name {
		return Node{}, false
	}
	return n, true
}

// follow keeps the cache current from revision rev+1 until Close; when
// the watch fails it reloads.
func (m *Membership) follow(rev int64) {
	backoff := 100 * time.Millisecond
	for {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(m.ctx))
		for resp := range m.cli.Watch(wctx, m.prefix, clientv3.WithPrefix(), clientv3.WithRev(rev+1)) {
			if resp.Err() != nil {
				break
			}
			m.apply(resp.Events)
			rev = max(rev, resp.Header.Revision)
		}
		cancel()
		for {
			if m.ctx.Err() != nil {
				return
			}
			r, err := m.load(m.ctx)
			if err == nil {
				rev, backoff = r, 100*time.Millisecond
				break
			}
			select {
			case <-time.After(backoff):
			case <-m.ctx.Done():
				return
			}
			backoff = min(2*backoff, 2*time.Second)
		}
	}
}

func (m *Membership) apply(evs []*clientv3.Event) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.mu.closed {
		return
	}
	var out []MemberEvent
	for _, ev := range evs {
		name, ok := strings.CutPrefix(string(ev.Kv.Key), m.prefix)
		if !ok {
			continue
		}
		old, had := m.mu.nodes[name]
		if ev.Type == clientv3.EventTypePut {
			if n, ok := m.decodeKV(ev.Kv.Key, ev.Kv.Value); ok {
				m.mu.nodes[name] = n
				if had {
					out = append(out, MemberEvent{Type: Updated, Node: n})
				} else {
					out = append(out, MemberEvent{Type: Joined, Node: n})
				}
				continue
			}
		}
		// A delete (Leave or expiry), or an entry this version cannot read.
		if had {
			delete(m.mu.nodes, name)
			out = append(out, MemberEvent{Type: Left, Node: old})
		}
	}
	m.publishLocked(out)
}

func (m *Membership) publishLocked(evs []MemberEvent) {
	if len(evs) == 0 {
		return
	}
	for w := range m.mu.watchers {
		w.Send(evs...)
	}
}

func nodeEqual(a, b Node) bool {
	return a.Name == b.Name && a.Addr == b.Addr && a.Capacity == b.Capacity && a.Used == b.Used &&
		a.Free == b.Free && a.Started.Equal(b.Started) && slices.Equal(a.Segments, b.Segments)
}
