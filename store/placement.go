package store

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Placement: where the bytes of a new version go, and how many copies.
//
// A file or directory carries its choice in two stored attributes (user.
// prefix stripped): XattrReplicas ("1" to MaxReplicas) and XattrPlacement
// ("local", "spread" or "node:NAME"). New objects inherit both from their
// nearest explicit ancestor directory at creation. Defaults: one replica,
// local.
//
//   - local: this node first; when it has no free space the draft spills
//     to the live node with the most free space (moving what it wrote so
//     far), and only when no node has room does this node evict;
//   - spread: the live node with the most free space;
//   - node:NAME: that node or nothing: a write that cannot be placed there
//     fails with ErrNoSpace instead of landing elsewhere.
//
// Further replicas go to distinct nodes, most free space first, and are
// copied from the first when the draft commits. Without enough live nodes
// the commit fails with ErrNoSpace.

// Attribute names of the placement choice.
const (
	XattrReplicas  = "mooncake.replicas"
	XattrPlacement = "mooncake.placement"
	// MaxReplicas bounds the replica count.
	MaxReplicas = 8
)

// Placement policies.
const (
	PolicyLocal  = "local"
	PolicySpread = "spread"
	PolicyNode   = "node"
)

// Placement is a resolved choice.
type Placement struct {
	Policy   string
	Node     string // PolicyNode only
	Replicas int
}

// DefaultPlacement is one replica, local first.
func DefaultPlacement() Placement { return Placement{Policy: PolicyLocal, Replicas: 1} }

func (p Placement) String() string {
	if p.Policy == PolicyNode {
		return "node:" + p.Node
	}
	return p.Policy
}

// ParsePlacement parses a user.mooncake.placement value.
func ParsePlacement(v string) (policy, node string, err error) {
	switch {
	case v == PolicyLocal || v == PolicySpread:
		return v, "", nil
	case strings.HasPrefix(v, "node:"):
		node = strings.TrimPrefix(v, "node:")
		if !ValidNodeName(node) {
			return "", "", fmt.Errorf("placement %q: bad node name (letters, digits, '.', '-' and '_', at most %d): %w", v, MaxNodeName, ErrInvalid)
		}
		return PolicyNode, node, nil
	}
	return "", "", fmt.Errorf("placement %q: want local, spread or node:NAME: %w", v, ErrInvalid)
}

// MaxNodeName bounds a node's name (a host name's bound).
const MaxNodeName = 253

// ValidNodeName says whether name can name a node: 1 to MaxNodeName
// letters, digits, '.', '-' and '_', as a host name has; replica lists
// (user.mooncake.location) and placement values carry it between spaces,
// colons and commas.
func ValidNodeName(name string) bool {
	if name == "" || len(name) > MaxNodeName {
		return false
	}
	for _, c := range []byte(name) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

// ParseReplicas parses a user.mooncake.replicas value as stored. It
// takes spaces around the number and a sign or leading zeros, as values
// set before CheckPlacement refused them may have; a value set now is
// the number alone (canonicalCount).
func ParseReplicas(v string) (int, error) {
	n, err := strconv.Atoi(strings.TrimSpace(v))
	if err != nil || n < 1 || n > MaxReplicas {
		return 0, fmt.Errorf("replicas %q: want 1 to %d: %w", v, MaxReplicas, ErrInvalid)
	}
	return n, nil
}

// canonicalCount says whether v is a positive number in decimal digits
// alone: no sign, space or leading zero.
func canonicalCount(v string) bool {
	if v == "" || v[0] == '0' {
		return false
	}
	for _, c := range []byte(v) {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// CheckPlacement validates a value of XattrReplicas or XattrPlacement
// (name) for this store: well formed, and one it can meet. A store with
// no Cluster places every byte on this node, so more than one replica,
// or a node of another name, could never be placed, and every write
// under it would fail (ErrNoSpace, some only at the close): refused
// here (ErrInvalid). A cluster's nodes come and go, so it takes any.
func (s *Store) CheckPlacement(name, v string) error {
	switch name {
	case XattrReplicas:
		if !canonicalCount(v) {
			return fmt.Errorf("replicas %q: want a number from 1 to %d, its digits alone: %w", v, MaxReplicas, ErrInvalid)
		}
		n, err := ParseReplicas(v)
		if err == nil && n > 1 && s.opts.Cluster == nil {
			return fmt.Errorf("replicas %d: this node is not in a cluster, one at most: %w", n, ErrInvalid)
		}
		return err
	case XattrPlacement:
		pol, node, err := ParsePlacement(v)
		if err == nil && pol == PolicyNode && node != s.opts.Node && s.opts.Cluster == nil {
			return fmt.Errorf("placement %q: this node (%q) is not in a cluster: %w", v, s.opts.Node, ErrInvalid)
		}
		return err
	}
	return fmt.Errorf("%q is no placement attribute: %w", name, ErrInvalid)
}

// placementOf reads o's own choice; ok fields say which attributes it has.
func placementOf(o *Object, p *Placement) (hasRepl, hasPol bool) {
	if v, ok := o.Xattrs[XattrReplicas]; ok {
		if n, err := ParseReplicas(string(v)); err == nil {
			p.Replicas, hasRepl = n, true
		}
	}
	if v, ok := o.Xattrs[XattrPlacement]; ok {
		if pol, node, err := ParsePlacement(string(v)); err == nil {
			p.Policy, p.Node, hasPol = pol, node, true
		}
	}
	return
}

// PlacementFor resolves the choice for key: its own attributes, else those
// of its nearest ancestor that has them, else the defaults.
func (s *Store) PlacementFor(ctx context.Context, key string) Placement {
	p := DefaultPlacement()
	var haveRepl, havePol bool
	var buf ancestorsBuf
	objs := s.ancestors(ctx, key, &buf) // nil: one Get each
	for i, k := 0, key; k != "" && !(haveRepl && havePol); i, k = i+1, Parent(k) {
		var o *Object
		if objs != nil {
			o = objs[i]
		} else if g, err := s.idx.Get(ctx, k); err == nil {
			o = g
		}
		if o == nil {
			continue
		}
		var q Placement
		r, pol := placementOf(o, &q)
		if r && !haveRepl {
			p.Replicas, haveRepl = q.Replicas, true
		}
		if pol && !havePol {
			p.Policy, p.Node, havePol = q.Policy, q.Node, true
		}
	}
	return p
}

// PlacementOf resolves the choice for o given dir, PlacementFor of o's
// directory: o's own attributes over dir's, as PlacementFor of o's key
// says without walking up again (a batch resolves each directory once).
func PlacementOf(o *Object, dir Placement) Placement {
	var q Placement
	repl, pol := placementOf(o, &q)
	if repl {
		dir.Replicas = q.Replicas
	}
	if pol {
		dir.Policy, dir.Node = q.Policy, q.Node
	}
	return dir
}

// inheritedXattrs are the attributes a new object takes from its nearest
// ancestor that has them, when it brings none of its own.
var inheritedXattrs = [...]string{XattrReplicas, XattrPlacement}

// inherit copies the placement attributes of o's nearest ancestors into
// a new object that has none of its own.
func (s *Store) inherit(ctx context.Context, o *Object) {
	s.ancestry(ctx, Parent(o.Key)).inherit(o)
}

// ancestry is what a new key in dir takes from dir and its ancestors:
// each of inheritedXattrs from the nearest one that has it (one walk up
// for all).
func (s *Store) ancestry(ctx context.Context, dir string) *parentInfo {
	pi := &parentInfo{}
	left := len(inheritedXattrs)
	for k := dir; k != "" && left > 0; k = Parent(k) {
		if a, err := s.idx.Get(ctx, k); err == nil {
			left = pi.take(a, left)
		}
	}
	return pi
}

// take sets each of inheritedXattrs that a has and pi has not found yet,
// and returns left less those it set.
func (pi *parentInfo) take(a *Object, left int) int {
	for i, name := range inheritedXattrs {
		if v, ok := a.Xattrs[name]; ok && !pi.found[i] {
			pi.attrs[i], pi.found[i] = v, true
			left--
		}
	}
	return left
}

// maxAncestry bounds the keys ancestors reads in one look: paths deeper
// than that ask each directory alone.
const maxAncestry = 8

// ancestorsBuf is room for ancestors' keys and objects.
type ancestorsBuf struct {
	keys [maxAncestry]string
	objs [maxAncestry]*Object
}

// ancestors returns the objects of key and of each of its ancestors, the
// root's excluded, nearest first (nil for a key without an object of its
// own), read with one look of the index (ManyFinder): a read lock each
// had a batch queue behind other calls' swaps. It returns nil when the
// index cannot (no FindMany, a deeper path, an error): ask each alone.
func (s *Store) ancestors(ctx context.Context, key string, buf *ancestorsBuf) []*Object {
	mf, ok := s.idx.(ManyFinder)
	if !ok || key == "" {
		return nil
	}
	keys := buf.keys[:0]
	for k := key; k != ""; k = Parent(k) {
		if len(keys) == maxAncestry {
			return nil
		}
		keys = append(keys, k)
	}
	objs := buf.objs[:len(keys)]
	if mf.FindMany(ctx, keys, objs) != nil {
		return nil
	}
	return objs
}

// parentInfoMany is checkParent and ancestry for a new key in dir from
// one look of the index (ancestors), and one more when dir has no object
// of its own (an implicit directory, or none). It returns nil when
// ancestors cannot answer.
func (s *Store) parentInfoMany(ctx context.Context, dir string) *parentInfo {
	var buf ancestorsBuf
	objs := s.ancestors(ctx, dir, &buf)
	if objs == nil {
		return nil
	}
	pi := &parentInfo{}
	switch {
	case objs[0] == nil:
		// As Stat: a directory if keys are under it, else missing. One
		// there again (renamed away and back since the look) has
		// attributes of its own to hand down: ask each alone.
		o, has, err := s.findEntry(ctx, dir)
		if o != nil && err == nil {
			return nil
		}
		if err != nil || !has {
			if err == nil {
				err = &keyError{"stat", dir, ErrNotFound}
			}
			pi.err = err
			return pi
		}
	case objs[0].Kind != KindDir:
		pi.err = fmt.Errorf("parent %q: %w", dir, ErrNotDir)
		return pi
	}
	for i, left := 0, len(inheritedXattrs); i < len(objs) && left > 0; i++ {
		if objs[i] != nil {
			left = pi.take(objs[i], left)
		}
	}
	return pi
}

// parentInfo is what the commit of a new key needs of its directory:
// whether it is one (checkParent's error) and the attributes its
// ancestors hand down.
type parentInfo struct {
	err   error
	attrs [len(inheritedXattrs)][]byte
	found [len(inheritedXattrs)]bool
}

// inherit sets in o each attribute pi holds that o has none of.
func (pi *parentInfo) inherit(o *Object) {
	for i, name := range inheritedXattrs {
		if !pi.found[i] {
			continue
		}
		if _, ok := o.Xattrs[name]; ok {
			continue
		}
		if o.Xattrs == nil {
			o.Xattrs = map[string][]byte{}
		}
		o.Xattrs[name] = slices.Clone(pi.attrs[i])
	}
}

// commitMemo is what the keys of one batch commit share, which all see
// the index as it was when they were checked (each key's swap still
// fails alone if it changed): one clock reading, and parentInfo per
// directory of new keys. A nil memo reads and looks up anew each time.
type commitMemo struct {
	now     int64
	parents DirMemo[*parentInfo] // the parents looked up
	// metaHeld is the metadata of the batch's new keys that found room,
	// counted in Store.metaHeld until the batch's swap: a batch must not
	// pass Options.MetaLimit by its own keys (leaving the next one to
	// fail while eviction catches up), nor by another batch's.
	metaHeld uint64
	// metaBudget is the part of metaHeld reserved for the batch's new keys
	// at once (reserveMeta) that no key has taken yet: a key that fits in
	// it takes its room from it without reading or writing the store's
	// shared counters, which calls in flight together otherwise pass
	// between their CPUs once per key.
	metaBudget uint64
	// kidsKnown: kids answers hasChildren for the batch's new keys, all
	// asked at once (knowKids); kids holds those that have children.
	kidsKnown bool
	kids      map[string]bool
}

// reserveMeta holds n bytes of metadata room for the batch's new keys
// at once (metaBudget), when they fit without evicting; otherwise each
// key finds its room alone (Store.metaRoom), evicting for it.
func (m *commitMemo) reserveMeta(s *Store, n uint64) {
	if n == 0 {
		return
	}
	if s.metaBytes()+uint64(max(s.metaHeld.Load(), 0))+n > s.opts.MetaLimit {
		return
	}
	s.metaHeld.Add(int64(n))
	m.metaHeld += n
	m.metaBudget += n
}

// takeMeta takes grow bytes of room for a new key from the batch's
// budget, reporting whether it held that much. A key that finds too
// little (one a directory's xattrs made larger) lets the rest go, so
// that it and the keys after it find their room alone, the budget not
// counted against them.
func (m *commitMemo) takeMeta(s *Store, grow uint64) bool {
	if m == nil {
		return false
	}
	if grow > m.metaBudget {
		if m.metaBudget > 0 {
			s.metaHeld.Add(-int64(m.metaBudget))
			m.metaHeld -= m.metaBudget
			m.metaBudget = 0
		}
		return false
	}
	m.metaBudget -= grow
	return true
}

// knowKids asks the index, once, which of keys (a batch's new keys) are
// implicit directories, when it can answer for many (ManyChildChecker);
// has is scratch of len(keys) at least. Otherwise each key asks alone.
func (m *commitMemo) knowKids(ctx context.Context, s *Store, keys []string, has []bool) {
	mc, ok := s.idx.(ManyChildChecker)
	if !ok || len(keys) < 2 {
		return
	}
	has = has[:len(keys)]
	if mc.HasChildrenMany(ctx, keys, has) != nil {
		return // each alone, which reports the error
	}
	m.kidsKnown = true
	for i, h := range has {
		if h {
			if m.kids == nil {
				m.kids = map[string]bool{}
			}
			m.kids[keys[i]] = true
		}
	}
}

// hasChildren is Store.hasChildren, answered from knowKids when it asked.
func (m *commitMemo) hasChildren(ctx context.Context, s *Store, key string) (bool, error) {
	if m != nil && m.kidsKnown {
		return m.kids[key], nil
	}
	return s.hasChildren(ctx, key)
}

// time returns the commit's time.
func (m *commitMemo) time(s *Store) int64 {
	if m == nil {
		return s.now()
	}
	if m.now == 0 {
		m.now = s.now()
	}
	return m.now
}

// parent returns the parentInfo of key's directory.
func (m *commitMemo) parent(ctx context.Context, s *Store, key string) *parentInfo {
	dir := Parent(key)
	if m != nil {
		if pi, ok := m.parents.Get(dir); ok {
			return pi
		}
	}
	pi := s.parentInfoMany(ctx, dir)
	if pi == nil {
		if err := s.checkParent(ctx, key); err != nil {
			pi = &parentInfo{err: err}
		} else {
			pi = s.ancestry(ctx, dir)
		}
	}
	if m != nil {
		m.parents.Put(dir, pi)
	}
	return pi
}

// NodeInfo is one live node as placement sees it.
type NodeInfo struct {
	Name     string
	Capacity uint64
	Free     uint64
}

// Cluster tells placement which nodes are alive and how full they are.
type Cluster interface {
	Nodes() []NodeInfo
}

// clustered reports whether other nodes can take bytes.
func (s *Store) clustered() bool { return s.opts.Cluster != nil && s.opts.Transport != nil }

func (s *Store) isLocal(node string) bool { return node == "" || node == s.opts.Node }

// liveNodes returns the live nodes, most free space first (this node's
// free space is read from its own segments).
func (s *Store) liveNodes() []NodeInfo {
	self := NodeInfo{Name: s.opts.Node}
	st := s.segs.Stats()
	self.Capacity, self.Free = st.Size, st.Free
	out := []NodeInfo{self}
	if s.clustered() {
		for _, n := range s.opts.Cluster.Nodes() {
			if n.Name != s.opts.Node {
				out = append(out, n)
			}
		}
	}
	slices.SortStableFunc(out, func(a, b NodeInfo) int {
		if c := cmp.Compare(b.Free, a.Free); c != 0 {
			return c
		}
		return cmp.Compare(a.Name, b.Name)
	})
	return out
}

// primaryNode picks the node of a draft's first reservation ("" for this
// node).
func (s *Store) primaryNode(p Placement, need uint64) (string, error) {
	switch p.Policy {
	case PolicyNode:
		if s.isLocal(p.Node) {
			return "", nil
		}
		for _, n := range s.liveNodes() {
			if n.Name == p.Node {
				return n.Name, nil
			}
		}
		return "", fmt.Errorf("placement node:%s: no such live node: %w", p.Node, ErrNoSpace)
	case PolicySpread:
		if n := s.liveNodes()[0].Name; !s.isLocal(n) {
			return n, nil
		}
	}
	return "", nil
}

// spillNode returns the remote node with the most free space if it has
// at least need bytes free.
func (s *Store) spillNode(need uint64) (string, bool) {
	if !s.clustered() {
		return "", false
	}
	for _, n := range s.liveNodes() {
		if !s.isLocal(n.Name) && n.Free >= need {
			return n.Name, true
		}
	}
	return "", false
}

// replicaNodes picks k nodes for further replicas, not in have.
func (s *Store) replicaNodes(k int, have map[string]bool, live func(string) bool) ([]string, error) {
	var out []string
	for _, n := range s.liveNodes() {
		if len(out) == k {
			break
		}
		if !have[n.Name] && (live == nil || live(n.Name)) {
			out = append(out, n.Name)
		}
	}
	if len(out) < k {
		return out, fmt.Errorf("%d more replicas wanted, %d distinct live nodes left: %w", k, len(out), ErrNoSpace)
	}
	return out, nil
}

var errNoTransport = errors.New("store: no transport to other nodes")
