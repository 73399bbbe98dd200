package store_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"sync/atomic"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// TestPutsModel puts rounds of keys in batches (new, replaced over the
// version checked, stale, twice in one batch, under a missing directory,
// too large, of no bytes, from memory that faults) and checks every key
// against a model after each round: each key commits or fails alone
// (once a key's swap failed, its later ones in the batch fail too), a
// failed one leaves nothing, and the store's space is that of the live
// values only.
func TestPutsModel(t *testing.T) {
	s := newTestStore(t, 4<<20, withOptions(func(o *store.Options) { o.Evict = false }))
	ctx := context.Background()
	if _, err := s.Mkdir(ctx, "d", nil); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 5))
	model := map[string][]byte{}
	version := map[string]*store.Object{}
	for round := range 12 {
		var specs []store.PutSpec
		type want struct {
			err  error
			data []byte
		}
		var wants []want
		ok := map[string]bool{}         // keys of this batch that commit
		swapFailed := map[string]bool{} // keys of this batch whose swap failed
		for k := range 20 {
			key := fmt.Sprintf("d/k%d", rng.IntN(30))
			data := pattern(byte(round*20+k), rng.IntN(40000))
			sp := store.PutSpec{Key: key, Bufs: splitBufs(rng, data), Cur: version[key],
				Template: store.Object{Mode: 0o640, Ino: store.NewIno()}, Place: store.DefaultPlacement(),
				SetXattrs: map[string][]byte{"user.round": fmt.Appendf(nil, "%d", round)}}
			w := want{data: data}
			switch r := rng.IntN(10); {
			case ok[key]:
				// The second of a key in one batch: the first commits, this
				// one finds another version than it checked.
				w.err = store.ErrConflict
				if version[key] == nil {
					w.err = store.ErrExists
				}
			case r == 0 && version[key] != nil:
				stale := *version[key]
				stale.Version--
				sp.Cur = &stale
				w.err = store.ErrConflict
			case r == 1:
				sp.Key, key, sp.Cur = "missing/"+key, "missing/"+key, nil
				w.err = store.ErrNotFound
			case r == 2:
				sp.Bufs = []transfer.Buffer{transfer.HostBuffer(make([]byte, 5<<20))}
				w.err = store.ErrNoSpace
			case r == 3:
				sp.Bufs = append(sp.Bufs, transfer.VMBuffer(os.Getpid(), 8, 4096)) // unmapped
				w.err = errAnyFailure
			case r == 4:
				sp.Bufs, w.data = nil, nil // an empty value, new or over one with bytes
			}
			// One that reaches the index after a put of its key failed
			// there fails too, untried: the caller puts them again in order.
			if reaches := w.err == nil || errors.Is(w.err, store.ErrConflict) || errors.Is(w.err, store.ErrExists); reaches {
				if swapFailed[key] {
					w.err = store.ErrConflict
				}
				swapFailed[key] = w.err != nil
			}
			if w.err == nil {
				ok[key] = true
			}
			specs = append(specs, sp)
			wants = append(wants, w)
		}
		objs, errs := s.StartPuts(ctx, specs).Commit()
		for i, sp := range specs {
			w := wants[i]
			if w.err != nil {
				if errs[i] == nil || !errors.Is(errs[i], w.err) && w.err != errAnyFailure {
					t.Fatalf("round %d: %s: %v, want %v", round, sp.Key, errs[i], w.err)
				}
				continue
			}
			if errs[i] != nil {
				t.Fatalf("round %d: %s: %v", round, sp.Key, errs[i])
			}
			if objs[i].Size != uint64(len(w.data)) || string(objs[i].Xattrs["user.round"]) != fmt.Sprint(round) {
				t.Fatalf("round %d: %s committed %+v", round, sp.Key, objs[i])
			}
			if got := segment.TotalLen(flatExtents(objs[i])); got != (uint64(len(w.data))+segment.Granule-1)/segment.Granule*segment.Granule {
				t.Fatalf("round %d: %s: %d B of extents for %d B", round, sp.Key, got, len(w.data))
			}
			if sp.Cur == nil && objs[i].Mode != 0o640 {
				t.Fatalf("round %d: new %s has mode %o", round, sp.Key, objs[i].Mode)
			}
			model[sp.Key], version[sp.Key] = w.data, objs[i]
		}
		var live uint64
		for key, data := range model {
			equalBytes(t, fmt.Sprintf("round %d: %s", round, key), s.read(t, key), data)
			live += (uint64(len(data)) + segment.Granule - 1) / segment.Granule * segment.Granule
		}
		if got := s.used(); got != live {
			t.Fatalf("round %d: %d B used, the live values take %d", round, got, live)
		}
		if held := store.MetaHeld(s.Store); held != 0 {
			t.Fatalf("round %d: %d B of metadata still held after the commit", round, held)
		}
		s.checkAlloc(t)
	}
}

var errAnyFailure = errors.New("any failure")

// flatExtents is every extent of o's replicas.
func flatExtents(o *store.Object) []segment.Extent {
	var ext []segment.Extent
	for _, r := range o.Replicas {
		ext = append(ext, r.Extents...)
	}
	return ext
}

// splitBufs cuts data into up to four host buffers.
func splitBufs(rng *rand.Rand, data []byte) []transfer.Buffer {
	var bufs []transfer.Buffer
	for len(data) > 0 {
		n := min(len(data), 1+rng.IntN(len(data)))
		if len(bufs) == 3 {
			n = len(data)
		}
		bufs = append(bufs, transfer.HostBuffer(data[:n]))
		data = data[n:]
	}
	return bufs
}

// TestPutsKeepReaders: a reader of the version a batch replaces reads it
// whole until it closes; then its room comes back.
func TestPutsKeepReaders(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	one, two := pattern(1, 100_000), pattern(2, 50_000)
	objs, errs := s.StartPuts(ctx, []store.PutSpec{{Key: "f", Bufs: []transfer.Buffer{transfer.HostBuffer(one)}, Place: store.DefaultPlacement()}}).Commit()
	if errs[0] != nil {
		t.Fatal(errs[0])
	}
	r, err := s.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	_, errs = s.StartPuts(ctx, []store.PutSpec{{Key: "f", Cur: objs[0], Bufs: []transfer.Buffer{transfer.HostBuffer(two)}, Place: store.DefaultPlacement()}}).Commit()
	if errs[0] != nil {
		t.Fatal(errs[0])
	}
	equalBytes(t, "new version", s.read(t, "f"), two)
	got := make([]byte, len(one))
	if _, err := r.ReadAt(ctx, got, 0); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "old version through its reader", got, one)
	r.Close()
	if got, want := s.used(), roundUp(uint64(len(two))); got != want {
		t.Fatalf("used %d after the reader closed, want %d", got, want)
	}
}

// TestPutsLaterSwapAfterFailure: a batch that puts a key twice, the
// first over a version replaced since (by another writer) and the second
// over the current one, commits neither: once the key's first swap
// failed, its later one is not tried (ErrConflict), so the caller, which
// puts the failed keys again in order, ends with the second value, not
// the first over it. Nothing of either stays in the store.
func TestPutsLaterSwapAfterFailure(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	place := store.DefaultPlacement()
	spec := func(cur *store.Object, v []byte) store.PutSpec {
		return store.PutSpec{Key: "k", Cur: cur, Bufs: []transfer.Buffer{transfer.HostBuffer(v)}, Place: place}
	}
	v1 := s.put(t, "k", pattern(1, 3000))
	v2 := s.put(t, "k", pattern(2, 3000)) // another writer, after v1 was looked up
	_, errs := s.StartPuts(ctx, []store.PutSpec{spec(v1, pattern(3, 3000)), spec(v2, pattern(4, 3000))}).Commit()
	for i, err := range errs {
		if !errors.Is(err, store.ErrConflict) {
			t.Fatalf("put %d of the key: %v, want ErrConflict", i, err)
		}
	}
	equalBytes(t, "k", s.read(t, "k"), pattern(2, 3000))
	if u := s.used(); u != roundUp(3000) {
		t.Fatalf("used %d B, want the one value's %d", u, roundUp(3000))
	}
}

// TestPutsOverImplicitDirectories: a batch's new keys whose names are
// implicit directories (keys exist below them) fail with ErrIsDir and
// leave nothing; the others commit, with the swap checking them
// (ChildGuard), with one look of the index for all of them before
// (ManyChildChecker), as with one look each (a batch of one).
func TestPutsOverImplicitDirectories(t *testing.T) {
	for _, unguarded := range []bool{false, true} {
		t.Run(fmt.Sprintf("unguarded=%v", unguarded), func(t *testing.T) {
			testPutsOverImplicitDirectories(t, &countingIndex{Embedded: store.NewEmbedded(), unguarded: unguarded})
		})
	}
}

func testPutsOverImplicitDirectories(t *testing.T, idx *countingIndex) {
	s := newTestStore(t, 1<<20, withIndex(idx))
	ctx := context.Background()
	s.create(t, "imp/x")
	s.create(t, "deep/a/b")
	for _, d := range []string{"imp", "deep/a", "deep"} {
		s.makeImplicit(t, d)
	}
	used := s.used()
	place := store.DefaultPlacement()
	spec := func(key string, b byte) store.PutSpec {
		return store.PutSpec{Key: key, Bufs: []transfer.Buffer{transfer.HostBuffer(pattern(b, 500))}, Place: place,
			Template: store.Object{Mode: 0o644, Ino: store.NewIno()}}
	}
	for _, keys := range [][]string{{"f1", "imp", "f2", "deep", "deep/a", "f3"}, {"imp"}, {"deep/a"}} {
		var specs []store.PutSpec
		for i, k := range keys {
			specs = append(specs, spec(k, byte(10+i)))
		}
		_, errs := s.StartPuts(ctx, specs).Commit()
		for i, k := range keys {
			switch k {
			case "imp", "deep", "deep/a":
				if !errors.Is(errs[i], store.ErrIsDir) {
					t.Fatalf("batch %q: put over %s: %v, want ErrIsDir", keys, k, errs[i])
				}
			default:
				if errs[i] != nil {
					t.Fatalf("batch %q: put %s: %v", keys, k, errs[i])
				}
				equalBytes(t, k, s.read(t, k), pattern(byte(10+i), 500))
			}
		}
	}
	if u := s.used(); u != used+3*roundUp(500) {
		t.Fatalf("used %d B, want %d: the failed keys left bytes", u, used+3*roundUp(500))
	}
	if _, err := s.Stat(ctx, "imp/x"); err != nil {
		t.Fatalf("imp/x after the puts: %v", err)
	}
}

// TestPutsParentChecks: a batch's new keys under a file fail with
// ErrNotDir, under a missing directory with ErrNotFound, and commit under
// an explicit directory and under an implicit one, several per directory
// (the commit reads each directory and its ancestors once).
func TestPutsParentChecks(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	s.put(t, "file", pattern(1, 10))
	if _, err := s.Mkdir(ctx, "d", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Mkdir(ctx, "d/e", nil); err != nil {
		t.Fatal(err)
	}
	s.create(t, "imp/x")
	s.makeImplicit(t, "imp")
	want := map[string]error{"file/a": store.ErrNotDir, "file/b": store.ErrNotDir, "none/a": store.ErrNotFound,
		"d/a": nil, "d/e/a": nil, "d/e/b": nil, "imp/a": nil, "imp/b": nil, "top": nil}
	var keys []string
	var specs []store.PutSpec
	for _, k := range []string{"file/a", "d/a", "none/a", "d/e/a", "imp/a", "file/b", "d/e/b", "imp/b", "top"} {
		keys = append(keys, k)
		specs = append(specs, store.PutSpec{Key: k, Bufs: []transfer.Buffer{transfer.HostBuffer(pattern(7, 300))},
			Place: store.DefaultPlacement(), Template: store.Object{Mode: 0o644, Ino: store.NewIno()}})
	}
	_, errs := s.StartPuts(ctx, specs).Commit()
	for i, k := range keys {
		if w := want[k]; w == nil && errs[i] != nil || w != nil && !errors.Is(errs[i], w) {
			t.Errorf("put %s: %v, want %v", k, errs[i], w)
		} else if w == nil {
			equalBytes(t, k, s.read(t, k), pattern(7, 300))
		}
	}
}

// TestPutsDeepInherit: directories deeper than one look of the index
// reads (maxAncestry) still take the placement of the top one, in
// PlacementFor and in a batch's commit.
func TestPutsDeepInherit(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	if _, err := s.Mkdir(ctx, "top", &store.Object{Xattrs: map[string][]byte{store.XattrPlacement: []byte(store.PolicyLocal)}}); err != nil {
		t.Fatal(err)
	}
	dir := "top"
	for depth := 2; depth <= 12; depth++ {
		dir += fmt.Sprintf("/d%d", depth)
		if _, err := s.Mkdir(ctx, dir, nil); err != nil {
			t.Fatal(err)
		}
		if depth < 7 && depth != 2 {
			continue
		}
		if p := s.PlacementFor(ctx, dir); p.Policy != store.PolicyLocal {
			t.Fatalf("depth %d: PlacementFor %+v, want the top's policy", depth, p)
		}
		var specs []store.PutSpec
		for _, k := range []string{"a", "b"} {
			specs = append(specs, store.PutSpec{Key: dir + "/" + k, Bufs: []transfer.Buffer{transfer.HostBuffer([]byte(k))},
				Place: store.DefaultPlacement(), Template: store.Object{Mode: 0o644, Ino: store.NewIno()}})
		}
		objs, errs := s.StartPuts(ctx, specs).Commit()
		for i := range specs {
			if errs[i] != nil || string(objs[i].Xattrs[store.XattrPlacement]) != store.PolicyLocal {
				t.Fatalf("depth %d: %s: %v, xattrs %q", depth, specs[i].Key, errs[i], objs[i].Xattrs)
			}
		}
	}
}

// countingIndex counts the index calls a batch commit makes.
type countingIndex struct {
	*store.Embedded
	get, findMany, hasChildren, hasChildrenMany atomic.Int64
	// unguarded hides the embedded index's check of Swap.NoKids
	// (ChildGuard): the store asks before the swap.
	unguarded bool
}

func (c *countingIndex) GuardsChildren() bool { return !c.unguarded }

func (c *countingIndex) Get(ctx context.Context, key string) (*store.Object, error) {
	c.get.Add(1)
	return c.Embedded.Get(ctx, key)
}

func (c *countingIndex) FindMany(ctx context.Context, keys []string, objs []*store.Object) error {
	c.findMany.Add(1)
	return c.Embedded.FindMany(ctx, keys, objs)
}

func (c *countingIndex) HasChildren(ctx context.Context, dir string) (bool, error) {
	c.hasChildren.Add(1)
	return c.Embedded.HasChildren(ctx, dir)
}

func (c *countingIndex) HasChildrenMany(ctx context.Context, dirs []string, has []bool) error {
	c.hasChildrenMany.Add(1)
	return c.Embedded.HasChildrenMany(ctx, dirs, has)
}

// TestPutsCommitLooksOnce: a batch commit of new keys under one directory
// three deep reads their directory with its ancestors in one look, and
// asks the index which are implicit directories once for all of them,
// or not at all when the swap checks (ChildGuard): no look of its own per
// key or per ancestor (each could queue behind other calls' swaps).
func TestPutsCommitLooksOnce(t *testing.T) {
	for _, unguarded := range []bool{false, true} {
		t.Run(fmt.Sprintf("unguarded=%v", unguarded), func(t *testing.T) { testPutsCommitLooksOnce(t, unguarded) })
	}
}

func testPutsCommitLooksOnce(t *testing.T, unguarded bool) {
	idx := &countingIndex{Embedded: store.NewEmbedded(), unguarded: unguarded}
	s := newTestStore(t, 1<<20, withIndex(idx))
	ctx := context.Background()
	for _, d := range []string{"a", "a/b", "a/b/c"} {
		if _, err := s.Mkdir(ctx, d, nil); err != nil {
			t.Fatal(err)
		}
	}
	var specs []store.PutSpec
	for i := range 16 {
		specs = append(specs, store.PutSpec{Key: fmt.Sprintf("a/b/c/k%d", i), Bufs: []transfer.Buffer{transfer.HostBuffer([]byte("v"))},
			Place: store.DefaultPlacement(), Template: store.Object{Mode: 0o644, Ino: store.NewIno()}})
	}
	idx.get.Store(0)
	idx.findMany.Store(0)
	idx.hasChildren.Store(0)
	idx.hasChildrenMany.Store(0)
	_, errs := s.StartPuts(ctx, specs).Commit()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("put %d: %v", i, err)
		}
	}
	wantMany := int64(0)
	if unguarded {
		wantMany = 1
	}
	if g, f, h, hm := idx.get.Load(), idx.findMany.Load(), idx.hasChildren.Load(), idx.hasChildrenMany.Load(); g != 0 || f != 1 || h != 0 || hm != wantMany {
		t.Fatalf("batch of 16 new keys: %d Get, %d FindMany, %d HasChildren, %d HasChildrenMany; want 0, 1, 0, %d", g, f, h, hm, wantMany)
	}
}

// TestBatchPutsPlacement: keys placed on another node, or with more than
// one replica, are not the batch path's.
func TestBatchPutsPlacement(t *testing.T) {
	s := newTestStore(t, 1<<20)
	p := store.DefaultPlacement()
	if !s.BatchPuts(p) {
		t.Fatal("the default placement is refused")
	}
	for name, q := range map[string]store.Placement{
		"other node": {Replicas: 1, Policy: store.PolicyNode, Node: "elsewhere"},
		"replicas":   {Replicas: 2, Policy: p.Policy},
	} {
		if s.BatchPuts(q) {
			t.Errorf("%s: taken", name)
		}
	}
	_, errs := s.StartPuts(context.Background(), []store.PutSpec{{Key: "f", Bufs: []transfer.Buffer{transfer.HostBuffer([]byte("x"))},
		Place: store.Placement{Replicas: 1, Policy: store.PolicyNode, Node: "elsewhere"}}}).Commit()
	if !errors.Is(errs[0], store.ErrInvalid) {
		t.Fatalf("a put placed elsewhere: %v", errs[0])
	}
}

// TestPutsInherit: the new keys of one batch take their directories'
// placement attributes from the nearest ancestor that has each, as a
// draft's commit does, also when several keys share a directory.
func TestPutsInherit(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	if _, err := s.Mkdir(ctx, "a", &store.Object{Xattrs: map[string][]byte{store.XattrPlacement: []byte(store.PolicyLocal), store.XattrReplicas: []byte("1")}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Mkdir(ctx, "a/b", &store.Object{Xattrs: map[string][]byte{store.XattrReplicas: []byte("1 ")}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Mkdir(ctx, "c", nil); err != nil {
		t.Fatal(err)
	}
	var specs []store.PutSpec
	for _, k := range []string{"a/b/x", "a/b/y", "a/z", "c/w", "a/b/x/no"} {
		specs = append(specs, store.PutSpec{Key: k, Bufs: []transfer.Buffer{transfer.HostBuffer([]byte(k))}, Place: store.DefaultPlacement()})
	}
	objs, errs := s.StartPuts(ctx, specs).Commit()
	want := map[string][2]string{"a/b/x": {"1 ", store.PolicyLocal}, "a/b/y": {"1 ", store.PolicyLocal}, "a/z": {"1", store.PolicyLocal}, "c/w": {"", ""}}
	for i, sp := range specs {
		w, ok := want[sp.Key]
		if !ok {
			if errs[i] == nil {
				t.Fatalf("%s under a key of the same batch committed", sp.Key)
			}
			continue
		}
		if errs[i] != nil {
			t.Fatalf("%s: %v", sp.Key, errs[i])
		}
		x := objs[i].Xattrs
		if string(x[store.XattrReplicas]) != w[0] || string(x[store.XattrPlacement]) != w[1] {
			t.Fatalf("%s inherited %q", sp.Key, x)
		}
	}
}

// TestEmbeddedFind: Find answers a miss with nothing, a hit with the
// object Get gives, and fails once closed.
func TestEmbeddedFind(t *testing.T) {
	ctx := context.Background()
	x := store.NewEmbedded()
	if o, err := x.Find(ctx, "k"); o != nil || err != nil {
		t.Fatalf("miss: %v, %v", o, err)
	}
	if _, err := x.CompareAndSwap(ctx, store.Swap{Key: "k", New: &store.Object{Key: "k", Kind: store.KindFile}}); err != nil {
		t.Fatal(err)
	}
	got, err := x.Find(ctx, "k")
	want, _ := x.Get(ctx, "k")
	if err != nil || got != want || got.Version == 0 {
		t.Fatalf("hit: %+v, %v (Get: %+v)", got, err, want)
	}
	x.Close()
	if _, err := x.Find(ctx, "k"); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("closed: %v", err)
	}
}

// TestPutsXattrsOfOldVersions: a put's attributes never show through a
// version it replaced (a reader may hold one), whether the put sets
// what the key had (the map is shared), changes or removes a value, or
// hands in a buffer it then reuses.
func TestPutsXattrsOfOldVersions(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	var cur *store.Object
	put := func(set map[string][]byte) *store.Object {
		t.Helper()
		objs, errs := s.StartPuts(ctx, []store.PutSpec{{Key: "k", Cur: cur, SetXattrs: set,
			Bufs: []transfer.Buffer{transfer.HostBuffer([]byte("v"))}, Place: store.DefaultPlacement()}}).Commit()
		if errs[0] != nil {
			t.Fatal(errs[0])
		}
		cur = objs[0]
		return cur
	}
	has := func(o *store.Object, want map[string]string) {
		t.Helper()
		got := map[string]string{}
		for k, v := range o.Xattrs {
			got[k] = string(v)
		}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("version %d holds %v, want %v", o.Version, got, want)
		}
	}
	buf := []byte("1")
	v1 := put(map[string][]byte{"user.a": buf, "user.b": []byte("x")})
	buf[0] = '9' // the caller's buffer, reused
	v2 := put(map[string][]byte{"user.a": []byte("1")})
	v3 := put(map[string][]byte{"user.a": []byte("2")})
	v4 := put(map[string][]byte{"user.b": nil, "user.c": nil})
	v5 := put(nil)
	has(v1, map[string]string{"user.a": "1", "user.b": "x"})
	has(v2, map[string]string{"user.a": "1", "user.b": "x"})
	has(v3, map[string]string{"user.a": "2", "user.b": "x"})
	has(v4, map[string]string{"user.a": "2"})
	has(v5, map[string]string{"user.a": "2"})
	if got, err := s.Stat(ctx, "k"); err != nil || got.Version != v5.Version {
		t.Fatalf("Stat: %+v, %v", got, err)
	} else {
		has(got, map[string]string{"user.a": "2"})
	}
}

// TestPutsSharedXattrs: new keys of a batch take a shared attribute map
// as it is, except where they have attributes of their own (inherited
// from their directory); a change of one key's attributes (Update), or a
// put that changes them, leaves the others as they were; a key that
// exists gets the set applied to its own map.
func TestPutsSharedXattrs(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	if _, err := s.Mkdir(ctx, "r", &store.Object{Xattrs: map[string][]byte{store.XattrReplicas: []byte("1")}}); err != nil {
		t.Fatal(err)
	}
	old, err := s.StartPuts(ctx, []store.PutSpec{{Key: "old", Bufs: []transfer.Buffer{transfer.HostBuffer([]byte("v"))},
		SetXattrs: map[string][]byte{"user.x": []byte("1")}, Place: store.DefaultPlacement()}}).Commit()
	if err[0] != nil {
		t.Fatal(err[0])
	}
	set := map[string][]byte{"user.meta": []byte("f16 (4,)")}
	var specs []store.PutSpec
	for _, k := range []string{"a", "b", "r/c", "old"} {
		sp := store.PutSpec{Key: k, Bufs: []transfer.Buffer{transfer.HostBuffer([]byte(k))}, SetXattrs: set, SharedXattrs: true,
			Place: store.DefaultPlacement()}
		if k == "old" {
			sp.Cur = old[0]
		}
		specs = append(specs, sp)
	}
	objs, errs := s.StartPuts(ctx, specs).Commit()
	if e := errors.Join(errs...); e != nil {
		t.Fatal(e)
	}
	shares := func(o *store.Object) bool {
		return reflect.ValueOf(o.Xattrs).UnsafePointer() == reflect.ValueOf(set).UnsafePointer()
	}
	if !shares(objs[0]) || !shares(objs[1]) || shares(objs[2]) || shares(objs[3]) {
		t.Fatalf("shared by a, b, r/c, old: %v %v %v %v", shares(objs[0]), shares(objs[1]), shares(objs[2]), shares(objs[3]))
	}
	if string(objs[2].Xattrs["user.meta"]) != "f16 (4,)" || string(objs[2].Xattrs[store.XattrReplicas]) != "1" ||
		string(objs[3].Xattrs["user.meta"]) != "f16 (4,)" || string(objs[3].Xattrs["user.x"]) != "1" {
		t.Fatalf("r/c holds %q, old %q", objs[2].Xattrs, objs[3].Xattrs)
	}
	if _, err := s.Update(ctx, "a", objs[0].Ino, func(o *store.Object) error {
		o.Xattrs["user.meta"] = []byte("changed")
		o.Xattrs["user.y"] = []byte("new")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	b, err2 := s.Stat(ctx, "b")
	if err2 != nil || len(b.Xattrs) != 1 || string(b.Xattrs["user.meta"]) != "f16 (4,)" || len(set) != 1 || string(set["user.meta"]) != "f16 (4,)" {
		t.Fatalf("b after a changed: %q (set %q), %v", b.Xattrs, set, err2)
	}
	if a, _ := s.Stat(ctx, "a"); string(a.Xattrs["user.meta"]) != "changed" || string(a.Xattrs["user.y"]) != "new" {
		t.Fatalf("a: %q", a.Xattrs)
	}
}

// TestPutsMoveLRU: the keys a batch commits become the most recently used,
// in the batch's order, and a key that fails keeps its place; so do the
// keys of readers (OpenReader) and of Touch: with the
// LRU kept in the embedded index (moved by the swap) and kept by the
// store (an index that does not keep one).
func TestPutsMoveLRU(t *testing.T) {
	for _, tc := range []struct {
		name string
		idx  store.Index
	}{
		{"keeper", store.NewEmbedded()},
		{"store", plainIndex{store.NewEmbedded()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestStore(t, 4<<20, withIndex(tc.idx), withOptions(func(o *store.Options) { o.Evict = false }))
			ctx := context.Background()
			cur := map[string]*store.Object{}
			put := func(keys ...string) []error {
				t.Helper()
				specs := make([]store.PutSpec, len(keys))
				for i, k := range keys {
					specs[i] = store.PutSpec{Key: k, Bufs: []transfer.Buffer{transfer.HostBuffer([]byte(k))}, Cur: cur[k],
						Template: store.Object{Mode: 0o644, Ino: store.NewIno()}, Place: store.DefaultPlacement()}
				}
				p := s.StartPuts(ctx, specs)
				objs, errs := p.Commit()
				for i, k := range keys {
					if errs[i] == nil {
						cur[k] = objs[i]
					}
				}
				errs = slices.Clone(errs) // Release reuses them
				p.Release()
				return errs
			}
			want := func(order ...string) {
				t.Helper()
				if got := store.LRUTail(s.Store, 100); !slices.Equal(got, order) {
					t.Fatalf("LRU, least recent first: %q, want %q", got, order)
				}
			}
			if errs := put("k0", "k1", "k2", "k3"); errors.Join(errs...) != nil {
				t.Fatal(errs)
			}
			want("k0", "k1", "k2", "k3")
			if errs := put("k2", "k0"); errors.Join(errs...) != nil {
				t.Fatal(errs)
			}
			want("k1", "k3", "k2", "k0")
			// k1 over a version it no longer has: fails, stays put; k3 moves.
			stale := *cur["k1"]
			stale.Version++
			cur["k1"] = &stale
			if errs := put("k1", "k3"); !errors.Is(errs[0], store.ErrConflict) || errs[1] != nil {
				t.Fatalf("puts over a stale version and a good one: %v", errs)
			}
			want("k1", "k2", "k0", "k3")
			// Readers: OpenReader moves its key up, OpenReadersUntouched
			// does not, and Touch moves the keys it is given, in order.
			untouched := func(ctx context.Context, key string) (*store.Reader, error) {
				rs, errs := s.OpenReadersUntouched(ctx, []string{key, "k3"})
				if errs != nil {
					s.CloseReaders(rs)
					return nil, errors.Join(errs...)
				}
				rs[1].Close()
				return rs[0], nil
			}
			for _, open := range []struct {
				fn    func(context.Context, string) (*store.Reader, error)
				order []string
			}{
				{untouched, []string{"k1", "k2", "k0", "k3"}},
				{s.OpenReader, []string{"k2", "k0", "k3", "k1"}},
			} {
				r, err := open.fn(ctx, "k1")
				if err != nil {
					t.Fatal(err)
				}
				r.Close()
				want(open.order...)
			}
			s.Touch("k2", "k0")
			want("k3", "k1", "k2", "k0")
		})
	}
}

// plainIndex is an Index and nothing more: a store over it keeps its own
// LRU.
type plainIndex struct{ store.Index }
