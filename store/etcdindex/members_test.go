package etcdindex

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/mooncake-fs/mooncake-fs/store"
)

// memberBound turns a hang into a failure; no test asserts a latency
// below it.
const memberBound = 20 * time.Second

func newClient(t *testing.T, s *etcdServer) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{s.ClientURL}, DialTimeout: 2 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

func testNode(name string) Node {
	return Node{Name: name, Addr: name + ":7070", Capacity: 100, Free: 100, Segments: []SegmentInfo{{ID: 1, Size: 100}}}
}

func join(t *testing.T, s *etcdServer, prefix, name string, ttl time.Duration) *Membership {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), memberBound)
	defer cancel()
	m, err := Join(ctx, newClient(t, s), testNode(name), MemberOptions{Prefix: prefix, TTL: ttl, UpdateEvery: 10 * time.Millisecond, RequestTimeout: 2 * time.Second})
	if err != nil {
		t.Fatalf("join %s: %v", name, err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func names(nodes []Node) []string {
	var out []string
	for _, n := range nodes {
		out = append(out, n.Name)
	}
	return out
}

func pollMembers(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(memberBound); !cond(); {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", memberBound, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// nextEvent returns the first event on ch that match accepts, failing
// after memberBound.
// watchedPair joins members a and b with ttl under a fresh prefix and
// returns b's watch, past the event of a's first join.
func watchedPair(t *testing.T, ttl time.Duration) (s *etcdServer, prefix string, a, b *Membership, bw <-chan MemberEvent) {
	t.Helper()
	s, prefix = startEtcd(t), freshPrefix()
	a, b = join(t, s, prefix, "a", ttl), join(t, s, prefix, "b", ttl)
	bw, err := b.Watch(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	nextEvent(t, bw, "initial joined a", is(Joined, "a"))
	return s, prefix, a, b, bw
}

func nextEvent(t *testing.T, ch <-chan MemberEvent, what string, match func(MemberEvent) bool) MemberEvent {
	t.Helper()
	timeout := time.After(memberBound)
	for {
		select {
		case e, ok := <-ch:
			if !ok {
				t.Fatalf("watch closed waiting for %s", what)
			}
			if match(e) {
				return e
			}
		case <-timeout:
			t.Fatalf("no event within %v: %s", memberBound, what)
		}
	}
}

func is(typ MemberEventType, name string) func(MemberEvent) bool {
	return func(e MemberEvent) bool { return e.Type == typ && e.Node.Name == name }
}

func TestMembersSeeEachOther(t *testing.T) {
	s := startEtcd(t)
	prefix := freshPrefix()
	a := join(t, s, prefix, "a", 10*time.Second)
	b := join(t, s, prefix, "b", 10*time.Second)
	// b loaded after its own join: it sees both at once.
	if got := names(b.Nodes()); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("b.Nodes() = %v", got)
	}
	pollMembers(t, "a sees b", func() bool { return slices.Equal(names(a.Nodes()), []string{"a", "b"}) })
	if !a.Live() || a.Err() != nil {
		t.Fatalf("a.Live() = %v, Err() = %v", a.Live(), a.Err())
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	bw, err := b.Watch(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The watch starts with the current view.
	for _, name := range []string{"a", "b"} {
		nextEvent(t, bw, "initial joined "+name, is(Joined, name))
	}

	n := testNode("a")
	n.Used, n.Free = 60, 40
	n.Segments = append(n.Segments, SegmentInfo{ID: 2, Size: 7})
	if err := a.Update(n); err != nil {
		t.Fatal(err)
	}
	e := nextEvent(t, bw, "updated a", is(Updated, "a"))
	if e.Node.Used != 60 || e.Node.Free != 40 || len(e.Node.Segments) != 2 || e.Node.Started.IsZero() {
		t.Fatalf("b's event for a's update: %+v", e.Node)
	}
	pollMembers(t, "b.Nodes() shows a's update", func() bool {
		ns := b.Nodes()
		return len(ns) == 2 && ns[0].Used == 60
	})
	if err := a.Update(testNode("x")); !errors.Is(err, store.ErrInvalid) {
		t.Fatalf("update under another name: %v, want ErrInvalid", err)
	}
	if err := (MemberOptions{TTL: -1, UpdateEvery: -1, RequestTimeout: -1}).Validate(); err == nil ||
		!strings.Contains(err.Error(), "TTL") || !strings.Contains(err.Error(), "UpdateEvery") || !strings.Contains(err.Error(), "RequestTimeout") {
		t.Fatalf("Validate reports %v; want every bad field", err)
	}
}

// TestMemberLeave: Leave revokes the lease, so the others see Left long
// before the TTL could run out.
func TestMemberLeave(t *testing.T) {
	s, prefix, a, b, bw := watchedPair(t, 60*time.Second)
	if err := a.Leave(); err != nil {
		t.Fatal(err)
	}
	e := nextEvent(t, bw, "a left", func(e MemberEvent) bool { return e.Node.Name == "a" && e.Type != Joined })
	if e.Type != Left || e.Node.Addr != "a:7070" {
		t.Fatalf("after Leave b saw %v %+v", e.Type, e.Node)
	}
	if got := names(b.Nodes()); !slices.Equal(got, []string{"b"}) {
		t.Fatalf("b.Nodes() after a left = %v", got)
	}
	if a.Live() {
		t.Fatal("a live after Leave")
	}
	if err := a.Update(testNode("a")); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("update after Leave: %v, want ErrClosed", err)
	}
	// The name is free again.
	join(t, s, prefix, "a", 60*time.Second)
}

// TestMemberExpiry: a member closed without Leave (a killed daemon) is
// reported Left when its lease expires.
func TestMemberExpiry(t *testing.T) {
	_, _, a, b, bw := watchedPair(t, 2*time.Second)
	closed := time.Now()
	a.Close()
	nextEvent(t, bw, "a expired", is(Left, "a"))
	t.Logf("a left %v after Close (TTL 2s)", time.Since(closed))
	if got := names(b.Nodes()); !slices.Equal(got, []string{"b"}) {
		t.Fatalf("b.Nodes() after a expired = %v", got)
	}
	if !b.Live() {
		t.Fatalf("b not live: %v", b.Err())
	}
}

func TestMemberNameTaken(t *testing.T) {
	s := startEtcd(t)
	prefix := freshPrefix()
	a := join(t, s, prefix, "a", 10*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), memberBound)
	defer cancel()
	_, err := Join(ctx, newClient(t, s), testNode("a"), MemberOptions{Prefix: prefix})
	if !errors.Is(err, ErrNameTaken) || !strings.Contains(err.Error(), "a:7070") {
		t.Fatalf("second join as a: %v, want ErrNameTaken naming a:7070", err)
	}
	if _, err := Join(ctx, newClient(t, s), Node{Name: "a/b"}, MemberOptions{Prefix: prefix}); !errors.Is(err, store.ErrInvalid) {
		t.Fatalf("join as a/b: %v, want ErrInvalid", err)
	}
	// The refused join left a's entry alone.
	if got := a.Nodes(); len(got) != 1 || got[0].Addr != "a:7070" || !a.Live() {
		t.Fatalf("a after refused join: %+v live %v", got, a.Live())
	}
}

// TestMemberLeaseLost: when the lease goes (revoked behind the member's
// back, as after a long outage), the member re-registers by itself.
func TestMemberLeaseLost(t *testing.T) {
	_, _, a, b, bw := watchedPair(t, 2*time.Second)
	a.mu.Lock()
	lease := a.mu.lease
	a.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), memberBound)
	defer cancel()
	if _, err := b.cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	nextEvent(t, bw, "a's key deleted", is(Left, "a"))
	nextEvent(t, bw, "a re-joined", is(Joined, "a"))
	pollMembers(t, "a live under a new lease", func() bool {
		a.mu.Lock()
		defer a.mu.Unlock()
		return a.mu.live && a.mu.lease != lease
	})
	pollMembers(t, "a sees itself again", func() bool { return slices.Equal(names(a.Nodes()), []string{"a", "b"}) })
}

// TestMemberEtcdRestart: with etcd away, Join fails within its ctx and a
// running member keeps its last view; when etcd returns, every member is
// live and visible again.
func TestMemberEtcdRestart(t *testing.T) {
	s := startEtcd(t)
	prefix := freshPrefix()
	a := join(t, s, prefix, "a", 2*time.Second)
	b := join(t, s, prefix, "b", 2*time.Second)
	pollMembers(t, "a sees b", func() bool { return len(a.Nodes()) == 2 })

	s.Stop()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	start := time.Now()
	_, err := Join(ctx, newClient(t, s), testNode("c"), MemberOptions{Prefix: prefix})
	cancel()
	if err == nil || !strings.Contains(err.Error(), "etcd unavailable") {
		t.Fatalf("join with etcd stopped: %v", err)
	}
	if took := time.Since(start); took > memberBound {
		t.Fatalf("join with etcd stopped took %v", took)
	}
	t.Logf("join with etcd stopped: %v", err)
	pollMembers(t, "a notices it is not live", func() bool { return !a.Live() })
	t.Logf("a not live: %v", a.Err())
	if got := names(a.Nodes()); !slices.Equal(got, []string{"a", "b"}) {
		t.Fatalf("a's view with etcd stopped = %v, want the last one", got)
	}
	n := testNode("a")
	n.Used = 99
	if err := a.Update(n); err != nil { // queued until etcd returns
		t.Fatal(err)
	}

	s.Start()
	pollMembers(t, "a and b live again", func() bool { return a.Live() && b.Live() })
	pollMembers(t, "b sees a's update made during the outage", func() bool {
		ns := b.Nodes()
		return slices.Equal(names(ns), []string{"a", "b"}) && ns[0].Used == 99
	})
	pollMembers(t, "a sees both", func() bool { return slices.Equal(names(a.Nodes()), []string{"a", "b"}) })
	// A newcomer sees them in etcd itself.
	c := join(t, s, prefix, "c", 2*time.Second)
	if got := names(c.Nodes()); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Fatalf("c.Nodes() after restart = %v", got)
	}
}
