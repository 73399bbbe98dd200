package fs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

func TestErrno(t *testing.T) {
	for _, c := range []struct {
		err  error
		want syscall.Errno
	}{
		{nil, 0},
		{store.ErrNotFound, syscall.ENOENT},
		{fmt.Errorf("get %q: %w", "k", store.ErrNotFound), syscall.ENOENT},
		{fmt.Errorf("a: %w", fmt.Errorf("b: %w", store.ErrNotEmpty)), syscall.ENOTEMPTY},
		{errors.Join(store.ErrNoSpace, segment.ErrNoSpace), syscall.ENOSPC},
		{fmt.Errorf("alloc: %w", segment.ErrNoSpace), syscall.ENOSPC},
		{store.ErrNameTooLong, syscall.ENAMETOOLONG},
		{fmt.Errorf("x: %w", syscall.EXDEV), syscall.EXDEV},
		{syscall.ENOSYS, syscall.EIO},
		{context.Canceled, syscall.EINTR},
		{fmt.Errorf("store: node restarted: %w", transfer.ErrStaleEpoch), syscall.EHOSTUNREACH},
		{errors.Join(store.ErrLost, transfer.ErrStaleEpoch), syscall.EIO},
		{errors.New("something unknown"), syscall.EIO},
	} {
		if got := toErrno(c.err); got != c.want {
			t.Errorf("toErrno(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

// TestDetached: a detached request is not cancelled with its request,
// and keeps the caller's credentials (and any other value) for the
// commit it runs.
func TestDetached(t *testing.T) {
	type other struct{}
	parent, cancel := context.WithCancel(context.WithValue(context.Background(), other{}, "v"))
	ctx := fuse.NewContext(parent, &fuse.Caller{Owner: fuse.Owner{Uid: 7, Gid: 8}, Pid: 9})
	d := detached(ctx)
	cancel()
	if ctx.Err() == nil || d.Err() != nil || d.Done() != nil {
		t.Fatalf("after cancel: request %v, detached %v (done %v)", ctx.Err(), d.Err(), d.Done())
	}
	if c, ok := fuse.FromContext(d); !ok || c.Uid != 7 || c.Gid != 8 || c.Pid != 9 {
		t.Fatalf("caller %+v, %v", c, ok)
	}
	if d.Value(other{}) != "v" {
		t.Fatal("detached lost a value")
	}
	if d := detached(context.Background()); d.Done() != nil {
		t.Fatal("no caller: not detached")
	}
}

// TestRuntimeWaits: the batch figures' lock waits grow with waits on a
// held lock, and the collector's CPU with a collection. The runtime
// samples one goroutine wait in eight, so the test waits 200 times. Their
// scheduling waits count the unsampled waits too: four goroutines that
// share one P for 200 ms wait about 600 ms in all (three wait while one
// runs), and the figure must say at least half of that (a busier machine
// only makes them wait longer).
func TestRuntimeWaits(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	_, before, _ := runtimeWaits()
	end := time.Now().Add(200 * time.Millisecond)
	var spin sync.WaitGroup
	for range 4 {
		spin.Go(func() {
			for time.Now().Before(end) {
				for t := time.Now(); time.Since(t) < 50*time.Microsecond; {
				}
				runtime.Gosched()
			}
		})
	}
	spin.Wait()
	if _, after, _ := runtimeWaits(); after-before < uint64(300*time.Millisecond) {
		t.Errorf("four goroutines on one P for 200 ms: %v of scheduling waits, want 300 ms or more", time.Duration(after-before))
	}

	lock0, sched0, gc0 := runtimeWaits()
	var mu sync.Mutex
	for range 200 {
		mu.Lock()
		go func() {
			time.Sleep(50 * time.Microsecond)
			mu.Unlock()
		}()
		mu.Lock() // waits for the goroutine's unlock
		mu.Unlock()
	}
	runtime.GC()
	lock1, sched1, gc1 := runtimeWaits()
	if lock1 <= lock0 || sched1 < sched0 || gc1 <= gc0 {
		t.Fatalf("lock waits %d -> %d, scheduling %d -> %d, collector %d -> %d ns", lock0, lock1, sched0, sched1, gc0, gc1)
	}
}

// TestOpenGoneFile: a read-only open of a node whose file went from under
// the kernel -- evicted, removed (it may have moved: a rename the kernel's
// tree does not show yet), replaced by another, or in a directory that
// moved -- answers ESTALE, so the kernel walks the path again; never
// ENOENT, which would fail an open with O_CREAT (the kernel does not pass
// it on to an OPEN) that the walk again makes the file for.
func TestOpenGoneFile(t *testing.T) {
	// Metadata for a few files: a new one evicts the least recently used.
	fx := newFixtureWith(t, 8<<20, true, func(o *store.Options) { o.MetaLimit = 4 << 10 })
	ctx := callerCtx(os.Getpid())
	st := fx.st
	open := func(n *node) syscall.Errno {
		fh, _, errno := n.Open(ctx, syscall.O_RDONLY)
		if errno == 0 {
			n.Release(ctx, fh)
		}
		return errno
	}
	data := bytes.Repeat([]byte{1}, 4096)
	child := func(parent *node, name string, o *store.Object) *node {
		n := fx.root.fs.newNode()
		parent.AddChild(name, parent.NewPersistentInode(ctx, n, gofs.StableAttr{Mode: fileType(o.Kind), Ino: o.Ino}), false)
		return n
	}
	put := func(key string) *store.Object {
		if res := runBatch(t, fx, true, []batchEntry{{key: key, data: data}}); res[0] != int64(len(data)) {
			t.Fatalf("put %s: %d", key, res[0])
		}
		o, err := st.Lookup(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return o
	}
	g := put("g")
	gn := child(fx.root, "g", g)
	if errno := open(gn); errno != 0 {
		t.Fatalf("open g: %v", errno)
	}
	var gone atomic.Bool // (evictions may run on the store's own goroutine)
	stop := st.OnEvict(func(_ string, ino uint64) {
		if ino == g.Ino {
			gone.Store(true)
		}
	})
	defer stop()
	for i := 0; !gone.Load(); i++ {
		if i == 64 {
			t.Fatal("g not evicted by 64 new files")
		}
		put(fmt.Sprintf("h%d", i))
	}
	if errno := open(gn); errno != syscall.ESTALE {
		t.Fatalf("open of an evicted g: %v, want ESTALE", errno)
	}
	if _, err := st.Create(ctx, "g", nil, true); err != nil { // another file, another inode
		t.Fatal(err)
	}
	if errno := open(gn); errno != syscall.ESTALE {
		t.Fatalf("open of g made anew: %v, want ESTALE", errno)
	}
	if err := st.Delete(ctx, "f", 0); err != nil {
		t.Fatal(err)
	}
	if errno := open(fx.file); errno != syscall.ESTALE {
		t.Fatalf("open of a removed f: %v, want ESTALE", errno)
	}
	// A file in a directory the store moved while the kernel's tree
	// still has it at its old key.
	d, err := st.Mkdir(ctx, "d", nil)
	if err != nil {
		t.Fatal(err)
	}
	dn := child(fx.root, "d", d)
	dg, err := st.Create(ctx, "d/g", nil, true)
	if err != nil {
		t.Fatal(err)
	}
	dgn := child(dn, "g", dg)
	if errno := open(dgn); errno != 0 {
		t.Fatalf("open d/g: %v", errno)
	}
	if err := st.Rename(ctx, "d", "e", 0); err != nil {
		t.Fatal(err)
	}
	if errno := open(dgn); errno != syscall.ESTALE {
		t.Fatalf("open of d/g after d moved: %v, want ESTALE", errno)
	}
}

// TestInvalidation: after a put by name, the kernel is told to forget
// the file's attributes when it knows the file's inode, the name when it
// knows the name for another inode (a file evicted since it looked), the
// negative entry when it was told the name is missing, and nothing when
// it knows nothing of the name or of a directory on the way.
func TestInvalidation(t *testing.T) {
	fx := newFixtureOf(t, 1<<20)
	ctx := callerCtx(os.Getpid())
	root := fx.root
	n := fx.root.fs.newNode()
	d := root.NewPersistentInode(ctx, fx.root.fs.newNode(), gofs.StableAttr{Mode: syscall.S_IFDIR, Ino: 7001})
	root.AddChild("d", d, false)
	d.AddChild("k", d.NewPersistentInode(ctx, n, gofs.StableAttr{Mode: syscall.S_IFREG, Ino: 7002}), false)
	for _, c := range []struct {
		rel     string
		ino     uint64
		ok      bool
		in      *gofs.Inode
		name    string
		content bool
	}{
		{rel: "d/k", ino: 7002, ok: true, in: &n.Inode, content: true},
		{rel: "d/k", ino: 7003, ok: true, in: d, name: "k"},
		{rel: "d/other", ino: 7004},
		{rel: "e/k", ino: 7005},
	} {
		inv, ok := root.invalidation(c.rel, c.ino)
		if ok != c.ok || inv.in != c.in || inv.name != c.name || inv.content != c.content {
			t.Errorf("invalidation(%q, %d) = %+v, %v; want in %p name %q content %v, %v", c.rel, c.ino, inv, ok, c.in, c.name, c.content, c.ok)
		}
	}
	fx.root.fs.neg.looking(7001, "asked", time.Hour)
	if inv, ok := root.invalidation("d/asked", 7006); !ok || inv.in != d || inv.name != "asked" || inv.content {
		t.Errorf("a name answered missing: %+v, %v; want its entry in d", inv, ok)
	}
	// A batch's new names, asked together (cachedMany): those answered
	// missing, in order, each once.
	fx.root.fs.neg.looking(7001, "m1", time.Hour)
	fx.root.fs.neg.looking(7001, "m3", time.Hour)
	var negs []invalidation
	for _, name := range []string{"m1", "m2", "m3", "k"} {
		inv, ok, neg := root.knownInvalidation("d/"+name, 7010)
		if ok == neg {
			t.Fatalf("knownInvalidation(d/%s): ok %v, neg %v", name, ok, neg)
		}
		if neg {
			negs = append(negs, inv)
		}
	}
	got := fx.root.fs.neg.cachedMany(negs)
	if len(got) != 2 || got[0].in != d || got[0].name != "m1" || got[1].in != d || got[1].name != "m3" {
		t.Errorf("cachedMany of m1, m2, m3 with m1 and m3 answered missing: %+v", got)
	}
	if again := fx.root.fs.neg.cachedMany([]invalidation{{in: d, name: "m1"}, {in: d, name: "m3"}}); len(again) != 0 || fx.root.fs.neg.n.Load() != 0 {
		t.Errorf("asked again: %+v, %d records left", again, fx.root.fs.neg.n.Load())
	}
}

// TestSpareProcs: after a mount, the scheduler has a P more than the
// server's readers can hold (go-fuse: max(2, min(16, procs)) + 1 of
// them), and never fewer Ps than it had; a GOMAXPROCS from the
// environment is kept.
func TestSpareProcs(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	t.Setenv("GOMAXPROCS", "2")
	runtime.GOMAXPROCS(2)
	if spareProcs(2); runtime.GOMAXPROCS(0) != 2 {
		t.Fatalf("GOMAXPROCS=2 in the environment: %d Ps after", runtime.GOMAXPROCS(0))
	}
	os.Unsetenv("GOMAXPROCS")
	for _, c := range []struct{ before, procs, want int }{
		{1, 1, 4}, {2, 2, 4}, {4, 4, 6}, {16, 16, 18}, {64, 64, 64}, {20, 16, 20}, {8, 32, 18},
	} {
		runtime.GOMAXPROCS(c.before)
		spareProcs(c.procs)
		if got := runtime.GOMAXPROCS(0); got != c.want {
			t.Errorf("GOMAXPROCS %d, server made at %d: %d after, want %d", c.before, c.procs, got, c.want)
		}
	}
}

// TestNegativesCount: the record of names answered missing keeps n, the
// count a commit reads before it takes the lock, in step: a name recorded
// is asked for (and forgotten) once, a lookup that found its key forgets
// it, records all expired are dropped at the next question, and a full
// record (overflow) answers yes for every name until it expires.
func TestNegativesCount(t *testing.T) {
	var g negatives
	if g.cached(1, "a") || g.n.Load() != 0 {
		t.Fatalf("empty record: n %d", g.n.Load())
	}
	g.looking(1, "a", time.Hour)
	g.looking(1, "b", time.Hour)
	if g.n.Load() != 2 {
		t.Fatalf("two names recorded: n %d", g.n.Load())
	}
	if !g.cached(1, "a") || g.cached(1, "a") || g.n.Load() != 1 {
		t.Fatalf("a asked twice: n %d", g.n.Load())
	}
	g.found(1, "b")
	if g.n.Load() != 0 || g.cached(1, "b") {
		t.Fatalf("b found: n %d", g.n.Load())
	}
	// Expired records go at the next question, whichever name it is.
	g.looking(2, "old", time.Nanosecond)
	if g.n.Load() != 1 {
		t.Fatalf("one record: n %d", g.n.Load())
	}
	time.Sleep(negSlack + 10*time.Millisecond)
	if g.cached(2, "other") || g.n.Load() != 0 || len(g.mu.until) != 0 {
		t.Fatalf("after every record expired: n %d, %d records", g.n.Load(), len(g.mu.until))
	}
	// A short record after a long one: not all expired, so none is
	// dropped, and the long one still answers.
	g.looking(2, "long", time.Hour)
	g.looking(2, "short", time.Nanosecond)
	time.Sleep(negSlack + 10*time.Millisecond)
	if g.cached(2, "other") || g.n.Load() != 2 || !g.cached(2, "long") || g.cached(2, "short") || g.n.Load() != 0 {
		t.Fatalf("a long record and a short one expired: n %d", g.n.Load())
	}
	// A full record: every name is answered yes while the overflow lasts.
	for i := range maxNegatives {
		g.looking(3, fmt.Sprint(i), time.Hour)
	}
	g.looking(3, "one more", time.Hour)
	if g.n.Load() != maxNegatives+1 || !g.cached(4, "never recorded") {
		t.Fatalf("overflow: n %d", g.n.Load())
	}
}
