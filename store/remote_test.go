package store_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

var clusterToken = []byte("remote-test-token-0123456789")

// newCluster returns stores on nodes "a" and "b" over one shared embedded
// index, each serving its segments over TCP and reading the other's
// through a TCPTransport.
func newCluster(t *testing.T, follow bool, opts ...testOpt) (a, b *testStore) {
	t.Helper()
	idx := store.NewEmbedded()
	t.Cleanup(func() { _ = idx.Close() })
	addrs := map[string]string{}
	view := &clusterView{}
	mk := func(node string) *testStore {
		tr, err := transfer.NewTCPTransport(transfer.TCPOptions{Token: clusterToken,
			Resolve: func(n string) (string, error) {
				if a, ok := addrs[n]; ok {
					return a, nil
				}
				return "", fmt.Errorf("unknown node %q", n)
			}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tr.Close() })
		s := newTestStore(t, 4<<20, append([]testOpt{withIndex(idx), noEvict(), withOptions(func(o *store.Options) {
			o.Node, o.Transport, o.Follow, o.Cluster = node, tr, follow, view
			o.Epoch = uint64(100 + len(addrs))
		})}, opts...)...)
		view.add(node, s)
		so := transfer.TCPServerOptions{Local: s.Table, Token: clusterToken, Control: s.Store, Bodies: s.Store, Writes: s.Store,
			Epoch: uint64(100 + len(addrs))}
		if serverHook != nil {
			serverHook(node, &so)
		}
		srv, err := transfer.NewTCPServer(so)
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addrs[node] = ln.Addr().String()
		go func() { _ = srv.Serve(ln) }()
		t.Cleanup(func() { _ = srv.Close() })
		return s
	}
	a, b = mk("a"), mk("b")
	testViews[a.Store], testViews[b.Store] = view, view
	return a, b
}

// serverHook, when set (by a test, reset at its end), edits the options
// of each TCP server newCluster starts.
var serverHook func(node string, o *transfer.TCPServerOptions)

// testViews finds the cluster view of a test store.
var testViews = map[*store.Store]*clusterView{}

// clusterView is the Cluster of the test stores: all live, free space
// read from their tables.
type clusterView struct {
	mu      sync.Mutex
	nodes   map[string]*testStore
	phantom []string // members that run no store (unreachable)
}

func (v *clusterView) add(name string, s *testStore) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.nodes == nil {
		v.nodes = map[string]*testStore{}
	}
	v.nodes[name] = s
}

func (v *clusterView) Nodes() []store.NodeInfo {
	v.mu.Lock()
	defer v.mu.Unlock()
	var out []store.NodeInfo
	for name, s := range v.nodes {
		st := s.Table.Stats()
		out = append(out, store.NodeInfo{Name: name, Capacity: st.Size, Free: st.Free})
	}
	for _, name := range v.phantom {
		out = append(out, store.NodeInfo{Name: name})
	}
	return out
}

// sync waits until s's follow loop processed every change committed so far
// (marked by a put of an empty sentinel key) and retired what it queued.
func (s *testStore) sync(t *testing.T) {
	t.Helper()
	o := s.put(t, "sync", nil)
	deadline := time.Now().Add(10 * time.Second)
	for {
		seen, idle := store.FollowState(s.Store)
		if seen >= o.Version && idle {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("follow loop at version %d (idle %v), want %d", seen, idle, o.Version)
		}
		time.Sleep(time.Millisecond)
	}
}

// waitUsed polls until s uses want bytes.
func (s *testStore) waitUsed(t *testing.T, want uint64) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for s.used() != want {
		if time.Now().After(deadline) {
			t.Fatalf("used %d B, want %d B", s.used(), want)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestRemoteRead(t *testing.T) {
	ctx := context.Background()
	a, b := newCluster(t, true)
	data := pattern(3, 300<<10+17)
	a.put(t, "f", data)
	r, err := b.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	got := make([]byte, len(data))
	if n, err := r.ReadAt(ctx, got, 0); err != nil || n != len(data) {
		t.Fatalf("ReadAt: %d, %v", n, err)
	}
	equalBytes(t, "remote ReadAt", got, data)
	for _, c := range []struct{ off, n int }{{1, 10}, {4095, 8193}, {100 << 10, 150 << 10}, {len(data) - 5, 100}} {
		p := make([]byte, c.n)
		n, err := r.ReadAt(ctx, p, uint64(c.off))
		want := data[c.off:min(c.off+c.n, len(data))]
		if err != nil || n != len(want) {
			t.Fatalf("ReadAt(%d, %d): %d, %v", c.off, c.n, n, err)
		}
		equalBytes(t, fmt.Sprintf("ReadAt(%d, %d)", c.off, c.n), p[:n], want)
	}
	if n, err := r.ReadAt(ctx, got, uint64(len(data))); n != 0 || err != nil {
		t.Fatalf("ReadAt at the end: %d, %v", n, err)
	}
	_, err = r.ReadTo(ctx, transfer.HostBuffer(got), uint64(len(data))+1)
	wantErr(t, "ReadTo past the end", err, store.ErrRange)
	reg := make([]byte, 64<<10)
	if n, err := r.ReadTo(ctx, transfer.Buffer{Kind: transfer.Registered, Mem: reg}, 7); err != nil || n != uint64(len(reg)) {
		t.Fatalf("ReadTo registered: %d, %v", n, err)
	}
	equalBytes(t, "ReadTo registered", reg, data[7:7+len(reg)])
	// Process memory goes through the engine's bounce buffer.
	vm := make([]byte, 200<<10)
	if n, err := r.ReadTo(ctx, transfer.VMBuffer(os.Getpid(), uint64(uintptr(unsafe.Pointer(&vm[0]))), uint64(len(vm))), 3); err != nil || n != uint64(len(vm)) {
		t.Fatalf("ReadTo process memory: %d, %v", n, err)
	}
	equalBytes(t, "ReadTo process memory", vm, data[3:3+len(vm)])
	_, err = r.Slices(0, 10)
	wantErr(t, "Slices", err, store.ErrRemote)
	if b.used() != 0 {
		t.Fatalf("remote reader uses %d B on b", b.used())
	}

	// A store without a Transport keeps failing with ErrLost.
	c := newTestStore(t, 1<<20, withIndex(a.Index), withOptions(func(o *store.Options) { o.Node = "c" }))
	_, err = c.OpenReader(ctx, "f")
	wantErr(t, "open without transport", err, store.ErrLost)

	// Copy on write from a remote base.
	d := b.edit(t, "f")
	if _, err := d.WriteAt(ctx, []byte("xyz"), 10); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	d.Close()
	want := append([]byte(nil), data...)
	copy(want[10:], "xyz")
	equalBytes(t, "edited on b", b.read(t, "f"), want)
	r.Close()
	a.sync(t)
	a.waitUsed(t, 0)
	a.checkAlloc(t)
}

func TestFollowFreesReplaced(t *testing.T) {
	ctx := context.Background()
	a, b := newCluster(t, true)
	old := pattern(1, 200<<10)
	a.put(t, "f", old)
	a.put(t, "g", pattern(2, 100<<10))
	full := a.used()
	r, err := a.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	nu := pattern(9, 50<<10)
	o := b.put(t, "f", nu)
	if _, ok := o.ReplicaOn("b"); !ok || len(o.Replicas) != 1 {
		t.Fatalf("replicas %+v, want one on b", o.Replicas)
	}
	a.sync(t)
	if a.used() != full {
		t.Fatalf("a used %d B with a reader open, want %d B", a.used(), full)
	}
	got := make([]byte, len(old))
	if n, err := r.ReadAt(ctx, got, 0); err != nil || n != len(old) {
		t.Fatalf("old reader: %d, %v", n, err)
	}
	equalBytes(t, "old reader after remote replace", got, old)
	r.Close()
	a.waitUsed(t, roundUp(100<<10))
	got = make([]byte, len(nu))
	r2, err := a.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	if n, err := r2.ReadAt(ctx, got, 0); err != nil || n != len(nu) {
		t.Fatalf("new version from a: %d, %v", n, err)
	}
	r2.Close()
	equalBytes(t, "new version from a", got, nu)

	// Delete on b frees on a.
	if err := b.Delete(ctx, "g", 0); err != nil {
		t.Fatal(err)
	}
	a.waitUsed(t, 0)
	a.checkAlloc(t)
	if b.used() != roundUp(50<<10) {
		t.Fatalf("b used %d B", b.used())
	}
}

func TestFollowRenameKeeps(t *testing.T) {
	a, b := newCluster(t, true)
	data := pattern(4, 70<<10)
	a.put(t, "f", data)
	a.mkdirAll(t, "d/x")
	a.put(t, "d/x", data)
	if err := b.Rename(context.Background(), "f", "h", 0); err != nil {
		t.Fatal(err)
	}
	if err := a.Rename(context.Background(), "d", "e", 0); err != nil {
		t.Fatal(err)
	}
	a.sync(t)
	if a.used() != 2*roundUp(70<<10) {
		t.Fatalf("a used %d B after renames", a.used())
	}
	equalBytes(t, "renamed on b", a.read(t, "h"), data)
	equalBytes(t, "renamed on a", a.read(t, "e/x"), data)
	equalBytes(t, "read on b", readOn(b, t, "h"), data)
}

func readOn(s *testStore, t *testing.T, key string) []byte {
	t.Helper()
	r, err := s.OpenReader(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	p := make([]byte, r.Size())
	if _, err := r.ReadAt(context.Background(), p, 0); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestFollowOff(t *testing.T) {
	a, b := newCluster(t, false)
	a.put(t, "f", pattern(1, 100<<10))
	full := a.used()
	b.put(t, "f", pattern(2, 10<<10))
	if a.used() != full {
		t.Fatalf("a used %d B without Follow, want %d B", a.used(), full)
	}
}

// TestFollowOwnCommits checks that the follow loop does not free again
// what this store's own commits retired, even when the extents were
// reused by a later body (a double free panics with -tags invariants and
// shows as wrong use otherwise).
func TestFollowOwnCommits(t *testing.T) {
	ctx := context.Background()
	a, b := newCluster(t, true)
	want := map[string][]byte{}
	for i := range 200 {
		key := fmt.Sprintf("k%d", i%5)
		switch i % 7 {
		case 3:
			if _, ok := want[key]; ok {
				if err := a.Delete(ctx, key, 0); err != nil {
					t.Fatal(err)
				}
				delete(want, key)
				continue
			}
		case 5:
			to := fmt.Sprintf("k%d", (i+2)%5)
			if _, ok := want[key]; ok {
				if err := a.Rename(ctx, key, to, 0); err != nil {
					t.Fatal(err)
				}
				want[to] = want[key]
				delete(want, key)
				continue
			}
		}
		data := pattern(byte(i), 4096*(1+i%4))
		a.put(t, key, data)
		want[key] = data
		if i%50 == 0 {
			a.sync(t)
		}
	}
	a.sync(t)
	var total uint64
	for k, v := range want {
		total += roundUp(uint64(len(v)))
		equalBytes(t, k, a.read(t, k), v)
		equalBytes(t, k+" on b", readOn(b, t, k), v)
	}
	if a.used() != total {
		t.Fatalf("a used %d B, want %d B", a.used(), total)
	}
	a.checkAlloc(t)
}
