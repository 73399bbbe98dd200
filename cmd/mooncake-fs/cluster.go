package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/store/etcdindex"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// Cluster mode: --etcd joins the daemon to a cluster. The index lives in
// etcd, the node registers itself (address, capacity, free space) under a
// lease, serves its segments to peers over TCP, and reaches theirs through
// the TCP transport. One node at a time, the live node with the smallest
// name, repairs: it drops replicas of nodes that left and restores replica
// counts.

// clusterConfig is what the cluster flags say.
type clusterConfig struct {
	etcd      string
	listen    string
	advertise string
	tokenFile string
	prefix    string
	ttl       time.Duration
}

// cluster is the running cluster side of a daemon.
type cluster struct {
	d       *daemon
	cli     *clientv3.Client
	members *etcdindex.Membership
	tr      *transfer.TCPTransport
	srv     *transfer.TCPServer
	ln      net.Listener
	token   []byte
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	mu      struct {
		sync.Mutex
		lost      []string
		repairErr string
		lastRound time.Time
		rounds    int
		seen      map[string]time.Time // last time each node was a member
		liveSince time.Time            // when this node started repairing
		gone      map[string]goneNode  // nodes that left, for status
	}
}

// readToken reads the cluster token: the file's content without
// surrounding white space, at least 16 bytes.
func readToken(path string) ([]byte, error) {
	if path == "" {
		return nil, errors.New("--token-file is required with --etcd: peers authenticate with the cluster token")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--token-file: %w", err)
	}
	b = bytes.TrimSpace(b)
	if len(b) < 16 {
		return nil, fmt.Errorf("--token-file %s: token of %d bytes, want at least 16", path, len(b))
	}
	return b, nil
}

// startCluster connects to etcd, listens, joins and builds the index and
// transport. The store is not made yet: see serve.
func (d *daemon) startCluster() error {
	cc := d.cfg.cluster
	token, err := readToken(cc.tokenFile)
	if err != nil {
		return err
	}
	c := &cluster{d: d}
	c.mu.gone = map[string]goneNode{}
	d.cl = c
	eps := strings.Split(cc.etcd, ",")
	c.cli, err = etcdindex.NewClient(eps, 5*time.Second, nil)
	if err != nil {
		return fmt.Errorf("--etcd %s: %w", cc.etcd, err)
	}
	if c.ln, err = net.Listen("tcp", cc.listen); err != nil {
		return fmt.Errorf("--listen %s: %w", cc.listen, err)
	}
	addr := cc.advertise
	if addr == "" {
		addr = c.ln.Addr().String()
		if host, _, _ := net.SplitHostPort(addr); net.ParseIP(host).IsUnspecified() {
			return fmt.Errorf("--listen %s binds every address: say which one peers dial with --advertise", cc.listen)
		}
	}
	self := etcdindex.Node{Name: d.cfg.node, Addr: addr, Started: d.started}
	st := d.segs.Stats()
	self.Capacity, self.Used, self.Free = st.Size, st.Used, st.Free
	for _, s := range d.segs.Segments() {
		self.Segments = append(self.Segments, etcdindex.SegmentInfo{ID: s.ID, Size: s.Alloc.Size()})
	}
	mo := etcdindex.MemberOptions{Prefix: cc.prefix, TTL: cc.ttl}
	// A node restarted right after a crash finds its old entry until the
	// old lease runs out: wait that long, not longer.
	deadline := time.Now().Add(2*cc.ttl + 5*time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		c.members, err = etcdindex.Join(ctx, c.cli, self, mo)
		cancel()
		if err == nil || !errors.Is(err, etcdindex.ErrNameTaken) || time.Now().After(deadline) {
			break
		}
		d.log.WithField("node", self.Name).Info("node name still held by a previous lease; waiting for it to expire")
		time.Sleep(time.Second)
	}
	if err != nil {
		return fmt.Errorf("join the cluster at %s as %q: %w", cc.etcd, self.Name, err)
	}
	idx, err := etcdindex.New(etcdindex.Options{Client: c.cli, Prefix: cc.prefix})
	if err != nil {
		return err
	}
	d.idx = idx
	c.tr, err = transfer.NewTCPTransport(transfer.TCPOptions{Token: token, Resolve: c.resolve})
	if err != nil {
		return err
	}
	c.token = token
	d.log.WithFields(logrus.Fields{"node": self.Name, "addr": addr, "etcd": cc.etcd}).Info("joined the cluster")
	return nil
}

// goneNode is a node that left, as status shows it.
type goneNode struct {
	node etcdindex.Node
	at   time.Time
}

// storeOptions fills the cluster fields of the store's options.
func (c *cluster) storeOptions(o *store.Options) {
	o.Transport = c.tr
	o.Epoch = c.epoch()
	o.Follow = true
	o.Cluster = c
	o.FreeDelay = 5 * time.Second
	o.Logf = func(f string, a ...any) { c.d.log.Warnf(f, a...) }
}

// serve runs once the store exists: forget replicas a previous life of
// this node held, start serving segments and the background loops.
func (c *cluster) serve() error {
	d := c.d
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	rep, err := d.st.DropNode(ctx, d.cfg.node)
	cancel()
	if err != nil {
		return fmt.Errorf("drop replicas of this node's previous run: %w", err)
	}
	if rep.Dropped > 0 {
		d.log.WithFields(logrus.Fields{"replicas": rep.Dropped, "lost": len(rep.Lost)}).Warn("dropped replicas this node held before it restarted")
	}
	c.srv, err = transfer.NewTCPServer(transfer.TCPServerOptions{Local: d.segs, Token: c.token, Control: d.st, Bodies: d.st, Writes: d.st, Epoch: c.epoch(),
		RDMA: d.rdma.path,
		Log:  func(f string, a ...any) { d.log.Warnf(f, a...) }})
	if err != nil {
		return err
	}
	go func() {
		if err := c.srv.Serve(c.ln); err != nil {
			d.log.WithError(err).Error("transport server stopped")
		}
	}()
	var bg context.Context
	bg, c.cancel = context.WithCancel(context.Background())
	c.wg.Add(2)
	go c.report(bg)
	go c.repairLoop(bg)
	return nil
}

// epoch is this daemon's incarnation: its start time. Replicas it writes
// carry it, and peers refuse to reach them through a later incarnation.
func (c *cluster) epoch() uint64 { return uint64(c.d.started.UnixNano()) }

// resolve maps a node name to its transport address.
func (c *cluster) resolve(node string) (string, error) {
	for _, n := range c.members.Nodes() {
		if n.Name == node {
			return n.Addr, nil
		}
	}
	return "", fmt.Errorf("node %q is not a live member of the cluster", node)
}

// Nodes implements store.Cluster.
func (c *cluster) Nodes() []store.NodeInfo {
	var out []store.NodeInfo
	for _, n := range c.members.Nodes() {
		out = append(out, store.NodeInfo{Name: n.Name, Capacity: n.Capacity, Free: n.Free})
	}
	return out
}

// report publishes this node's use once a second.
func (c *cluster) report(ctx context.Context) {
	defer c.wg.Done()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		st := c.d.segs.Stats()
		self := etcdindex.Node{Name: c.d.cfg.node}
		for _, n := range c.members.Nodes() {
			if n.Name == self.Name {
				self = n
			}
		}
		self.Used, self.Free = st.Used, st.Free
		_ = c.members.Update(self)
	}
}

// repairLoop runs Reconcile on the repairing node after every membership
// change and every few seconds.
func (c *cluster) repairLoop(ctx context.Context) {
	defer c.wg.Done()
	evs, err := c.members.Watch(ctx)
	if err != nil {
		c.d.log.WithError(err).Error("watch cluster membership; repair is off")
		return
	}
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-evs:
			if !ok {
				return
			}
			c.mu.Lock()
			if ev.Type == etcdindex.Left {
				c.mu.gone[ev.Node.Name] = goneNode{node: ev.Node, at: time.Now()}
			} else {
				delete(c.mu.gone, ev.Node.Name)
			}
			c.mu.Unlock()
			if ev.Type == etcdindex.Left {
				c.d.log.WithField("node", ev.Node.Name).Warn("node left the cluster")
				if rd := c.d.rdma; rd != nil && rd.path != nil {
					rd.path.Forget(ev.Node.Name) // its queue pairs, both ways
				}
			}
		case <-t.C:
		}
		c.repairRound(ctx)
	}
}

func (c *cluster) repairRound(ctx context.Context) {
	nodes := c.members.Nodes()
	if !c.members.Live() || len(nodes) == 0 || nodes[0].Name != c.d.cfg.node {
		// Not this node's turn (the smallest live name repairs), or it
		// is cut off: start the grace over when it repairs again.
		c.mu.Lock()
		c.mu.seen = nil
		c.mu.Unlock()
		return
	}
	// A node counts as gone only after it has been missing for a grace
	// period: after an etcd outage every lease may have run out, and the
	// others re-register a moment after this one.
	now := time.Now()
	grace := 2*c.d.cfg.cluster.ttl + 3*time.Second
	c.mu.Lock()
	if c.mu.seen == nil {
		c.mu.seen = map[string]time.Time{}
		c.mu.liveSince = now
	}
	for _, n := range nodes {
		c.mu.seen[n.Name] = now
	}
	seen := maps.Clone(c.mu.seen)
	settled := now.Sub(c.mu.liveSince) >= grace
	c.mu.Unlock()
	live := func(n string) bool {
		t, ok := seen[n]
		// Unknown names (never seen since this node started repairing)
		// are judged only once this node has watched for a whole grace.
		return (ok && now.Sub(t) < grace) || (!ok && !settled)
	}
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	rep, err := c.d.st.Reconcile(rctx, live)
	cancel()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.mu.rounds++
	c.mu.lastRound = time.Now()
	c.mu.lost = rep.Lost
	c.mu.repairErr = ""
	if err != nil {
		c.mu.repairErr = err.Error()
	}
	if rep.Dropped > 0 || rep.Repaired > 0 {
		c.d.log.WithFields(logrus.Fields{"dropped": rep.Dropped, "repaired": rep.Repaired,
			"lost": len(rep.Lost), "short": rep.Short}).Warn("repaired replicas")
	}
}

func (c *cluster) stop() {
	if c.cancel != nil {
		c.cancel()
	}
	c.wg.Wait()
	if c.srv != nil {
		_ = c.srv.Close()
	}
	if c.ln != nil {
		_ = c.ln.Close()
	}
	if c.members != nil {
		// Leave at once: peers drop this node's replicas now rather than
		// after the lease runs out.
		if err := c.members.Leave(); err != nil {
			c.d.log.WithError(err).Warn("leave the cluster")
		}
		_ = c.members.Close()
	}
	if c.tr != nil {
		_ = c.tr.Close()
	}
}

// closeClient closes the etcd client after the index.
func (c *cluster) closeClient() {
	if c.cli != nil {
		_ = c.cli.Close()
	}
}

// ClusterStatus is the cluster part of status.
type ClusterStatus struct {
	Etcd         string       `json:"etcd"`
	Addr         string       `json:"addr"`
	Live         bool         `json:"live"`
	LiveErr      string       `json:"live_error,omitempty"`
	Nodes        []NodeStatus `json:"nodes"`
	Lost         []string     `json:"lost,omitempty"`
	LostCount    int          `json:"lost_count"`
	Repairer     string       `json:"repairer"`
	RepairRounds int          `json:"repair_rounds"`
	RepairError  string       `json:"repair_error,omitempty"`
	Reservations int          `json:"reservations"`
	// SyncFailures counts peers that did not confirm a commit of this
	// node in time (dead, cut off, or with another token).
	SyncFailures uint64 `json:"sync_failures"`
	// ReservationsMade and ReservationsReaped count reservations for
	// writers on other nodes since start, and those that expired unused.
	ReservationsMade   uint64 `json:"reservations_made"`
	ReservationsReaped uint64 `json:"reservations_reaped"`
	// Holds are other nodes' open readers keeping replaced bodies here;
	// Holding, this node's readers keeping bodies on other nodes.
	Holds   int `json:"holds"`
	Holding int `json:"holding"`
	// DelayedFreeBytes are retired bytes waiting out the free delay.
	DelayedFreeBytes int64                   `json:"delayed_free_bytes"`
	Transport        transfer.TCPStats       `json:"transport"`
	Server           transfer.TCPServerStats `json:"server"`
}

// NodeStatus is one member as the cluster sees it.
type NodeStatus struct {
	Name     string    `json:"name"`
	Addr     string    `json:"addr"`
	Capacity uint64    `json:"capacity"`
	Used     uint64    `json:"used"`
	Free     uint64    `json:"free"`
	Segments int       `json:"segments"`
	Started  time.Time `json:"started"`
	Live     bool      `json:"live"`
	Left     time.Time `json:"left,omitzero"` // when a gone node's lease ended
}

const maxLostListed = 100

func (c *cluster) status() *ClusterStatus {
	cs := &ClusterStatus{Etcd: c.d.cfg.cluster.etcd, Addr: c.ln.Addr().String(), Live: c.members.Live(),
		Transport: c.tr.Stats(), Server: c.srv.Stats()}
	st := c.d.st.Stats()
	cs.Reservations, cs.ReservationsMade, cs.ReservationsReaped = st.Reservations, st.Reserved, st.Reaped
	cs.SyncFailures, cs.DelayedFreeBytes = st.SyncFails, st.DelayedFree
	cs.Holds, cs.Holding = st.Holds, st.Holding
	if err := c.members.Err(); err != nil {
		cs.LiveErr = err.Error()
	}
	for i, n := range c.members.Nodes() {
		if i == 0 {
			cs.Repairer = n.Name
		}
		cs.Nodes = append(cs.Nodes, NodeStatus{Name: n.Name, Addr: n.Addr, Capacity: n.Capacity, Used: n.Used,
			Free: n.Free, Segments: len(n.Segments), Started: n.Started, Live: true})
	}
	c.mu.Lock()
	for _, g := range c.mu.gone {
		cs.Nodes = append(cs.Nodes, NodeStatus{Name: g.node.Name, Addr: g.node.Addr, Capacity: g.node.Capacity,
			Segments: len(g.node.Segments), Started: g.node.Started, Live: false, Left: g.at})
	}
	cs.LostCount = len(c.mu.lost)
	cs.Lost = slices.Clone(c.mu.lost[:min(len(c.mu.lost), maxLostListed)])
	cs.RepairRounds, cs.RepairError = c.mu.rounds, c.mu.repairErr
	c.mu.Unlock()
	if cs.Repairer != c.d.cfg.node {
		// Only the repairer keeps the list; the others look it up.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		if lost, err := c.d.st.Lost(ctx); err == nil {
			cs.LostCount = len(lost)
			cs.Lost = lost[:min(len(lost), maxLostListed)]
		}
		cancel()
	}
	return cs
}
