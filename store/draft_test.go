package store_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

func TestCommitMakesContentVisible(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	data := pattern(1, 10_000)
	ino := store.NewIno()
	d := s.NewDraft(ino, nil, true)
	defer d.Close()
	if n, err := d.WriteAt(ctx, data, 0); err != nil || n != len(data) {
		t.Fatalf("WriteAt: %d, %v", n, err)
	}
	// Nothing is visible before the commit.
	if _, err := s.Stat(ctx, "f"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("Stat before commit: %v", err)
	}
	equalBytes(t, "draft before commit", readDraft(t, d), data)
	o, err := d.Commit(ctx, store.CommitOptions{Key: "f", Template: &store.Object{Ino: ino, Mode: 0o600, Uid: 5}})
	if err != nil {
		t.Fatal(err)
	}
	if o.Size != uint64(len(data)) || o.Ino != ino || o.Mode != 0o600 || o.Uid != 5 || o.Version == 0 || o.Kind != store.KindFile {
		t.Fatalf("committed %+v", o)
	}
	st, err := s.Stat(ctx, "f")
	if err != nil || st.Size != uint64(len(data)) || st.Version != o.Version {
		t.Fatalf("Stat = %+v, %v", st, err)
	}
	equalBytes(t, "committed", s.read(t, "f"), data)
	if d.Dirty() {
		t.Error("draft dirty right after its commit")
	}
	// The reservation's tail was trimmed: only the rounded size is used.
	if got, want := s.used(), roundUp(uint64(len(data))); got != want {
		t.Errorf("Used = %d after commit, want %d", got, want)
	}
	if st := s.Stats(); st.Commits == 0 || st.Revokes != 0 {
		t.Errorf("stats %+v", st)
	}
	// Short reads at the end, nothing past it.
	r, err := s.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	buf := make([]byte, 100)
	if n, err := r.ReadAt(ctx, buf, uint64(len(data))-10); n != 10 || err != nil {
		t.Fatalf("ReadAt at end-10: %d, %v", n, err)
	}
	equalBytes(t, "tail", buf[:10], data[len(data)-10:])
	if n, err := r.ReadAt(ctx, buf, uint64(len(data))); n != 0 || err != nil {
		t.Fatalf("ReadAt at end: %d, %v", n, err)
	}
	if sl, err := r.Slices(uint64(len(data)), 10); len(sl) != 0 || err != nil {
		t.Fatalf("Slices at end: %v, %v", sl, err)
	}
}

func TestCommitEmptyFile(t *testing.T) {
	s := newTestStore(t, 1<<20)
	o := s.put(t, "empty", nil)
	if o.Size != 0 || len(o.Replicas) != 0 {
		t.Fatalf("empty object %+v", o)
	}
	if got := s.read(t, "empty"); len(got) != 0 {
		t.Fatalf("read %d B", len(got))
	}
	// Truncating a file to zero and committing releases its bytes.
	s.put(t, "f", pattern(2, 50_000))
	d := s.edit(t, "f")
	if err := d.Truncate(context.Background(), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Commit(context.Background(), store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if got := s.read(t, "f"); len(got) != 0 {
		t.Fatalf("read %d B after truncate to 0", len(got))
	}
	if u := s.used(); u != 0 {
		t.Fatalf("Used = %d, want 0", u)
	}
}

// A reader opened before a replacing commit keeps its version, and the old
// bytes are freed exactly when the last reader lets go.
func TestReaderKeepsOldVersionUntilClose(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	v1 := pattern(1, 30_000)
	v2 := pattern(2, 70_000)
	s.put(t, "f", v1)
	r1, err := s.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	r2, err := s.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	s.put(t, "f", v2)
	equalBytes(t, "new readers", s.read(t, "f"), v2)
	both := roundUp(uint64(len(v1))) + roundUp(uint64(len(v2)))
	if u := s.used(); u != both {
		t.Fatalf("Used = %d with the old version held, want %d", u, both)
	}
	for i, r := range []*store.Reader{r1, r2} {
		got, err := readAll(r)
		if err != nil {
			t.Fatal(err)
		}
		equalBytes(t, fmt.Sprintf("reader %d of the old version", i), got, v1)
	}
	r1.Close()
	if u := s.used(); u != both {
		t.Fatalf("Used = %d after the first of two readers closed, want %d", u, both)
	}
	got, _ := readAll(r2)
	equalBytes(t, "second reader after the first closed", got, v1)
	r2.Close()
	r2.Close() // closing twice is a no-op
	if u, want := s.used(), roundUp(uint64(len(v2))); u != want {
		t.Fatalf("Used = %d after the last reader closed, want %d", u, want)
	}
	// Deleting while a reader is open: same rule.
	r3, err := s.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Delete(ctx, "f", 0); err != nil {
		t.Fatal(err)
	}
	got, _ = readAll(r3)
	equalBytes(t, "reader of a deleted file", got, v2)
	if u := s.used(); u != roundUp(uint64(len(v2))) {
		t.Fatalf("Used = %d with a deleted file open", u)
	}
	r3.Close()
	if u := s.used(); u != 0 {
		t.Fatalf("Used = %d after the deleted file's reader closed", u)
	}
	if st := s.Stats(); st.LiveBodies != 0 || st.OpenObjects != 0 {
		t.Fatalf("stats after everything closed: %+v", st)
	}
}

func TestReaderHold(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	v1 := pattern(1, 20_000)
	s.put(t, "f", v1)
	r, err := s.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	sl, err := r.Slices(1000, 5000)
	if err != nil {
		t.Fatal(err)
	}
	release := r.Hold()
	r.Close()
	s.put(t, "f", pattern(2, 20_000)) // replace: v1 is retired but held
	equalBytes(t, "held slices after Close and replace", bytes.Join(sl, nil), v1[1000:6000])
	if u := s.used(); u != 2*roundUp(20_000) {
		t.Fatalf("Used = %d while held", u)
	}
	release()
	release() // only the first call counts
	if u := s.used(); u != roundUp(20_000) {
		t.Fatalf("Used = %d after the hold was released", u)
	}
}

func TestDraftCloseRevokes(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	base := pattern(1, 12_345)
	s.put(t, "f", base)
	before := s.used()
	revokes := s.Stats().Revokes

	// A new draft written and dropped.
	d := s.NewDraft(store.NewIno(), nil, true)
	if _, err := d.WriteAt(ctx, pattern(2, 300_000), 0); err != nil {
		t.Fatal(err)
	}
	if s.used() <= before {
		t.Fatal("a written draft reserved nothing")
	}
	d.Close()
	d.Close()
	if u := s.used(); u != before {
		t.Fatalf("Used = %d after revoking a new draft, want %d", u, before)
	}
	if _, err := d.WriteAt(ctx, []byte("x"), 0); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("WriteAt after Close: %v", err)
	}
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "g"}); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("Commit after Close: %v", err)
	}
	if err := d.Truncate(ctx, 5); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("Truncate after Close: %v", err)
	}

	// A copy-on-write draft of an existing file, changed and dropped.
	d = s.edit(t, "f")
	if _, err := d.WriteAt(ctx, []byte("changed"), 100); err != nil {
		t.Fatal(err)
	}
	d.Close()
	if u := s.used(); u != before {
		t.Fatalf("Used = %d after revoking a copy-on-write draft, want %d", u, before)
	}
	if got := s.Stats().Revokes; got != revokes+2 {
		t.Fatalf("Revokes = %d, want %d", got, revokes+2)
	}
	equalBytes(t, "file after revoked drafts", s.read(t, "f"), base)
	if _, err := s.Stat(ctx, "g"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("Stat(g): %v", err)
	}
	// An unchanged draft is not a revoke.
	d = s.edit(t, "f")
	d.Close()
	if got := s.Stats().Revokes; got != revokes+2 {
		t.Fatalf("Revokes = %d after closing an unchanged draft", got)
	}
	if st := s.Stats(); st.OpenObjects != 0 {
		t.Fatalf("OpenObjects = %d", st.OpenObjects)
	}
}

func TestCommitExclusive(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	orig := pattern(1, 5000)
	s.put(t, "f", orig)
	before := s.used()
	d := s.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	if _, err := d.WriteAt(ctx, pattern(2, 5000), 0); err != nil {
		t.Fatal(err)
	}
	_, err := d.Commit(ctx, store.CommitOptions{Key: "f", Exclusive: true})
	wantErr(t, "exclusive commit over an existing key", err, store.ErrExists)
	equalBytes(t, "existing file", s.read(t, "f"), orig)
	// The draft is still usable: commit it elsewhere.
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "g", Exclusive: true}); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "g", s.read(t, "g"), pattern(2, 5000))
	d.Close()
	if u := s.used(); u != before+roundUp(5000) {
		t.Fatalf("Used = %d, want %d", u, before+roundUp(5000))
	}
}

// raceIndex is a fault-injecting Index: before the first CompareAndSwap it
// runs hook once, to let a competitor win a race deterministically.
type raceIndex struct {
	store.Index
	once sync.Once
	hook func()
}

func (x *raceIndex) CompareAndSwap(ctx context.Context, swaps ...store.Swap) (uint64, error) {
	x.once.Do(func() {
		if x.hook != nil {
			x.hook()
		}
	})
	return x.Index.CompareAndSwap(ctx, swaps...)
}

// An exclusive commit that loses the race between its check and its swap
// reports ErrExists, like one that loses it earlier, not a bare conflict
// (which fs would turn into EAGAIN).
func TestCommitExclusiveRace(t *testing.T) {
	x := &raceIndex{Index: store.NewEmbedded()}
	s := newTestStore(t, 4<<20, withIndex(x))
	ctx := context.Background()
	x.hook = func() {
		o := &store.Object{Key: "f", Kind: store.KindFile, Ino: 77, Mode: 0o644}
		if _, err := x.Index.CompareAndSwap(ctx, store.Swap{Key: "f", New: o}); err != nil {
			t.Error(err)
		}
	}
	d := s.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	if _, err := d.WriteAt(ctx, []byte("mine"), 0); err != nil {
		t.Fatal(err)
	}
	_, err := d.Commit(ctx, store.CommitOptions{Key: "f", Exclusive: true})
	wantErr(t, "exclusive commit that lost the race", err, store.ErrExists)
	if o, err := s.Stat(ctx, "f"); err != nil || o.Ino != 77 {
		t.Fatalf("Stat = %+v, %v; want the winner", o, err)
	}
}

// panicIndex is a fault-injecting Index whose Get panics while armed, as
// a defect in the index's client would.
type panicIndex struct {
	store.Index
	armed atomic.Bool
}

func (x *panicIndex) Get(ctx context.Context, key string) (*store.Object, error) {
	if x.armed.Load() {
		panic("panicIndex: armed")
	}
	return x.Index.Get(ctx, key)
}

// newPanicStore is a 4 MiB store over a panicIndex, holding "old" (3 MiB
// of pattern 1): a write of more than 1 MiB must evict, which asks the
// index.
func newPanicStore(t *testing.T) (*panicIndex, *testStore) {
	x := &panicIndex{Index: store.NewEmbedded()}
	s := newTestStore(t, 4<<20, withIndex(x))
	s.put(t, "old", pattern(1, 3<<20))
	return x, s
}

// A panic while a write reserves room (here in eviction, which asks the
// index) lets the draft go: go-fuse recovers a handler's panic, and a
// draft left held made the file's close wait forever.
func TestWritePanicLetsDraftGo(t *testing.T) {
	x, s := newPanicStore(t)
	ctx := context.Background()
	d := s.NewDraft(store.NewIno(), nil, true)
	panicsIn(t, x, func() { _, _ = d.WriteAt(ctx, pattern(2, 2<<20), 0) })
	closesFailed(t, "the draft", d)
	equalBytes(t, "old", s.read(t, "old"), pattern(1, 3<<20))
}

// panicsIn runs fn with x armed and fails t unless fn panics.
func panicsIn(t *testing.T, x *panicIndex, fn func()) {
	t.Helper()
	defer x.armed.Store(false)
	defer func() {
		if recover() == nil {
			t.Fatal("the write that evicts did not reach the index")
		}
	}()
	x.armed.Store(true)
	fn()
}

// closesFailed fails t unless d, whose write panicked, closes (within a
// minute: a draft left held waits forever) and may no longer commit.
func closesFailed(t *testing.T, what string, d *store.Draft) {
	t.Helper()
	closed := make(chan struct{})
	go func() {
		d.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(time.Minute):
		t.Fatalf("Close of %s still waits a minute after the panic", what)
	}
	if d.Err() == nil {
		t.Errorf("%s may still commit", what)
	}
}

// The same through WriteMany (a batch put's drafts): the second draft's
// reservation panics after the first was prepared; both are let go and
// failed (the first one's copy never ran).
func TestWriteManyPanicLetsDraftsGo(t *testing.T) {
	x, s := newPanicStore(t)
	ctx := context.Background()
	d1 := s.NewDraft(store.NewIno(), nil, true)
	d2 := s.NewDraft(store.NewIno(), nil, true)
	d1.Expect(64 << 10)
	panicsIn(t, x, func() {
		s.WriteMany(ctx, []store.DraftWrite{
			{Draft: d1, Bufs: []transfer.Buffer{transfer.HostBuffer(pattern(2, 64<<10))}},
			{Draft: d2, Bufs: []transfer.Buffer{transfer.HostBuffer(pattern(3, 2<<20))}},
		})
	})
	closesFailed(t, "draft 1", d1)
	closesFailed(t, "draft 2", d2)
}

// BaseReader: the version a draft goes on from while it has no changes
// of its own (the one it was opened on, then each it committed), held
// apart from the draft; none while it has changes, or once it is closed.
func TestDraftBaseReader(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	o := s.put(t, "k", pattern(1, 8192))
	d := s.edit(t, "k")
	r := d.BaseReader()
	if r == nil || r.Object().Version != o.Version {
		t.Fatalf("BaseReader of a fresh draft: %v, want version %d", r, o.Version)
	}
	if _, err := d.WriteAt(ctx, pattern(2, 100), 0); err != nil {
		t.Fatal(err)
	}
	if d.BaseReader() != nil {
		t.Fatal("BaseReader of a draft with changes of its own")
	}
	c, err := d.Commit(ctx, store.CommitOptions{Key: "k"})
	if err != nil {
		t.Fatal(err)
	}
	after := d.BaseReader()
	if after == nil || after.Object().Version != c.Version {
		t.Fatalf("BaseReader after a commit: %v, want version %d", after, c.Version)
	}
	d.Close()
	if d.BaseReader() != nil {
		t.Fatal("BaseReader of a closed draft")
	}
	// Each lease outlives the draft and reads its own version.
	s.put(t, "k", pattern(3, 4096))
	buf := make([]byte, 8192)
	for _, c := range []struct {
		r    *store.Reader
		want []byte
	}{{r, pattern(1, 8192)}, {after, append(pattern(2, 100), pattern(1, 8192)[100:]...)}} {
		n, err := c.r.ReadAt(ctx, buf, 0)
		if err != nil && n != len(buf) {
			t.Fatal(err)
		}
		equalBytes(t, "lease", buf[:n], c.want)
		c.r.Close()
	}
}

// Writes racing Close of a draft over a committed version: a writer that
// found the draft open and not yet its own must get ErrClosed, not find
// the base Close dropped (a nil dereference).
func TestWriteRacingClose(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	s.put(t, "k", pattern(1, 64<<10))
	for i := range 300 {
		d := s.edit(t, "k")
		var wg sync.WaitGroup
		start := make(chan struct{})
		for w := range 4 {
			wg.Go(func() {
				<-start
				for {
					// Each commit makes the draft's version the base again.
					if _, err := d.WriteAt(ctx, []byte("x"), uint64(10+w*4096)); err != nil {
						if !errors.Is(err, store.ErrClosed) {
							t.Errorf("write: %v", err)
						}
						return
					}
					if _, err := d.Commit(ctx, store.CommitOptions{Key: "k"}); err != nil {
						return
					}
				}
			})
		}
		close(start)
		time.Sleep(time.Duration(i%10) * 50 * time.Microsecond)
		d.Close()
		wg.Wait()
	}
}

func TestCommitIfIno(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	o := s.put(t, "f", pattern(1, 100))
	d := s.edit(t, "f")
	defer d.Close()
	if _, err := d.WriteAt(ctx, []byte("x"), 0); err != nil {
		t.Fatal(err)
	}
	// Same inode: fine, even after a metadata change bumped the version.
	if _, err := s.Update(ctx, "f", 0, func(n *store.Object) error { n.Mode = 0o600; return nil }); err != nil {
		t.Fatal(err)
	}
	c, err := d.Commit(ctx, store.CommitOptions{Key: "f", IfIno: o.Ino})
	if err != nil {
		t.Fatal(err)
	}
	if c.Mode != 0o600 || c.Ino != o.Ino {
		t.Fatalf("commit lost the metadata change: %+v", c)
	}
	// The file is replaced by another inode (renamed over): stale.
	s.put(t, "g", pattern(2, 100))
	if err := s.Rename(ctx, "g", "f", 0); err != nil {
		t.Fatal(err)
	}
	if _, err := d.WriteAt(ctx, []byte("y"), 1); err != nil {
		t.Fatal(err)
	}
	_, err = d.Commit(ctx, store.CommitOptions{Key: "f", IfIno: o.Ino})
	wantErr(t, "commit to a replaced file", err, store.ErrStale)
	equalBytes(t, "replacement", s.read(t, "f"), pattern(2, 100))
	// The file is gone: stale.
	if err := s.Delete(ctx, "f", 0); err != nil {
		t.Fatal(err)
	}
	_, err = d.Commit(ctx, store.CommitOptions{Key: "f", IfIno: o.Ino})
	wantErr(t, "commit to a removed file", err, store.ErrStale)
	if _, err := s.Stat(ctx, "f"); !errors.Is(err, store.ErrNotFound) {
		t.Fatalf("stale commit recreated the file: %v", err)
	}
	d.Close()
	if u := s.used(); u != 0 {
		t.Fatalf("Used = %d after everything is gone", u)
	}
}

func TestCommitPlacement(t *testing.T) {
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	if _, err := s.Mkdir(ctx, "dir", nil); err != nil {
		t.Fatal(err)
	}
	s.put(t, "file", []byte("x"))
	s.mkdirAll(t, "imp/child")
	s.put(t, "imp/child", []byte("x"))
	s.makeImplicit(t, "imp")
	for _, tc := range []struct {
		key  string
		want error
	}{
		{"dir", store.ErrIsDir},
		{"imp", store.ErrIsDir},
		{"missing/f", store.ErrNotFound},
		{"file/f", store.ErrNotDir},
		{"bad//name", store.ErrInvalidName},
		{"", store.ErrInvalidName},
	} {
		d := s.NewDraft(store.NewIno(), nil, true)
		if _, err := d.WriteAt(ctx, []byte("data"), 0); err != nil {
			t.Fatal(err)
		}
		_, err := d.Commit(ctx, store.CommitOptions{Key: tc.key})
		d.Close()
		wantErr(t, fmt.Sprintf("commit to %q", tc.key), err, tc.want)
	}
	if o, err := s.Stat(ctx, "imp"); err != nil || o.Kind != store.KindDir {
		t.Fatalf("Stat(imp) = %+v, %v; want the implicit directory to stay one", o, err)
	}
	if u := s.used(); u != 2*roundUp(1) {
		t.Fatalf("Used = %d, want two one-granule files", u)
	}
}

// A copy-on-write draft written in the middle keeps the rest of the bytes,
// and the base is not touched until the commit.
func TestCopyOnWrite(t *testing.T) {
	s := newTestStore(t, 4<<20, withSegments(2))
	ctx := context.Background()
	base := pattern(1, 600_000) // larger than the first reservation: several extents
	s.put(t, "f", base)
	r, err := s.OpenReader(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	d := s.edit(t, "f")
	defer d.Close()
	if d.Dirty() || d.Size() != uint64(len(base)) {
		t.Fatalf("fresh draft: dirty %v size %d", d.Dirty(), d.Size())
	}
	equalBytes(t, "unchanged draft reads the base", readDraft(t, d), base)
	patch := pattern(9, 1000)
	if _, err := d.WriteAt(ctx, patch, 300_000); err != nil {
		t.Fatal(err)
	}
	want := bytes.Clone(base)
	copy(want[300_000:], patch)
	equalBytes(t, "draft", readDraft(t, d), want)
	equalBytes(t, "committed before commit", s.read(t, "f"), base)
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "after commit", s.read(t, "f"), want)
	got, _ := readAll(r)
	equalBytes(t, "old reader", got, base)

	// The draft goes on from the committed version.
	if _, err := d.WriteAt(ctx, []byte("end"), uint64(len(want))); err != nil {
		t.Fatal(err)
	}
	want = append(want, "end"...)
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "second commit", s.read(t, "f"), want)
	// An unchanged draft commits nothing, even if someone else committed.
	other := pattern(3, 10)
	s.put(t, "f", other)
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "after an empty commit", s.read(t, "f"), other)
	d.Close()
	r.Close()
	if u, w := s.used(), roundUp(uint64(len(other))); u != w {
		t.Fatalf("Used = %d, want %d", u, w)
	}
	s.checkAlloc(t)
}

func TestTruncate(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	base := pattern(1, 10_000)
	s.put(t, "f", base)

	t.Run("up fills zeros", func(t *testing.T) {
		d := s.edit(t, "f")
		defer d.Close()
		if err := d.Truncate(ctx, 50_000); err != nil {
			t.Fatal(err)
		}
		want := append(bytes.Clone(base), make([]byte, 40_000)...)
		equalBytes(t, "draft", readDraft(t, d), want)
		if !d.Dirty() {
			t.Error("truncated draft not dirty")
		}
	})
	t.Run("down then up reads zeros", func(t *testing.T) {
		d := s.edit(t, "f")
		defer d.Close()
		if err := d.Truncate(ctx, 3000); err != nil {
			t.Fatal(err)
		}
		equalBytes(t, "down", readDraft(t, d), base[:3000])
		if err := d.Truncate(ctx, 9000); err != nil {
			t.Fatal(err)
		}
		want := append(bytes.Clone(base[:3000]), make([]byte, 6000)...)
		equalBytes(t, "down then up", readDraft(t, d), want)
		if _, err := d.Commit(ctx, store.CommitOptions{Key: "g"}); err != nil {
			t.Fatal(err)
		}
		equalBytes(t, "committed", s.read(t, "g"), want)
		// Again on the committed version, across the granule the commit trimmed at.
		if err := d.Truncate(ctx, 100); err != nil {
			t.Fatal(err)
		}
		if err := d.Truncate(ctx, 20_000); err != nil {
			t.Fatal(err)
		}
		want = append(bytes.Clone(base[:100]), make([]byte, 19_900)...)
		equalBytes(t, "down then up after commit", readDraft(t, d), want)
	})
	t.Run("written draft down then up", func(t *testing.T) {
		d := s.NewDraft(store.NewIno(), nil, true)
		defer d.Close()
		data := pattern(2, 8000)
		if _, err := d.WriteAt(ctx, data, 0); err != nil {
			t.Fatal(err)
		}
		if err := d.Truncate(ctx, 10); err != nil {
			t.Fatal(err)
		}
		if _, err := d.WriteAt(ctx, []byte("z"), 7000); err != nil {
			t.Fatal(err)
		}
		want := make([]byte, 7001)
		copy(want, data[:10])
		want[7000] = 'z'
		equalBytes(t, "draft", readDraft(t, d), want)
	})
	t.Run("to zero", func(t *testing.T) {
		d := s.edit(t, "f")
		defer d.Close()
		if err := d.Truncate(ctx, 0); err != nil {
			t.Fatal(err)
		}
		if d.Size() != 0 {
			t.Fatalf("size %d", d.Size())
		}
		if err := d.Truncate(ctx, 5); err != nil {
			t.Fatal(err)
		}
		equalBytes(t, "zero then five", readDraft(t, d), make([]byte, 5))
	})
	equalBytes(t, "base after revoked drafts", s.read(t, "f"), base)
}

func TestWritePastEOFLeavesZeroGap(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	base := pattern(1, 5000)
	s.put(t, "f", base)
	d := s.edit(t, "f")
	defer d.Close()
	tail := pattern(2, 3000)
	const off = 400_000 // past the first reservation
	if _, err := d.WriteAt(ctx, tail, off); err != nil {
		t.Fatal(err)
	}
	// And a small gap inside the reservation, from a fresh draft.
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, off+len(tail))
	copy(want, base)
	copy(want[off:], tail)
	equalBytes(t, "sparse file", s.read(t, "f"), want)

	n := s.NewDraft(store.NewIno(), nil, true)
	defer n.Close()
	if _, err := n.WriteAt(ctx, []byte("b"), 5000); err != nil {
		t.Fatal(err)
	}
	if _, err := n.WriteAt(ctx, []byte("a"), 10); err != nil {
		t.Fatal(err)
	}
	want = make([]byte, 5001)
	want[10], want[5000] = 'a', 'b'
	equalBytes(t, "new sparse draft", readDraft(t, n), want)
	if _, err := n.WriteAt(ctx, []byte("x"), ^uint64(0)); !errors.Is(err, store.ErrTooLarge) {
		t.Fatalf("write past 2^64: %v", err)
	}
}

func TestConcurrentDisjointWrites(t *testing.T) {
	s := newTestStore(t, 16<<20, withSegments(2), withSmallCopies())
	ctx := context.Background()
	s.put(t, "f", pattern(1, 100_000))
	d := s.edit(t, "f") // copy on write races with the writers
	defer d.Close()
	const writers, pieces, piece = 8, 16, 9000
	want := make([]byte, writers*pieces*piece)
	copy(want, pattern(1, 100_000))
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := range writers {
		wg.Go(func() {
			// Writer w owns pieces w, w+writers, ...; written back to
			// front so the draft grows from many goroutines at once.
			for p := pieces - 1; p >= 0; p-- {
				i := p*writers + w
				data := pattern(byte(i), piece)
				if _, err := d.WriteAt(ctx, data, uint64(i*piece)); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	for w := range writers {
		for p := range pieces {
			i := p*writers + w
			copy(want[i*piece:], pattern(byte(i), piece))
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "after concurrent writes", s.read(t, "f"), want)
	d.Close()
	if u := s.used(); u != roundUp(uint64(len(want))) {
		t.Fatalf("Used = %d, want %d", u, roundUp(uint64(len(want))))
	}
	s.checkAlloc(t)
}

// Writes racing with commits of the same draft (one file open twice, one
// handle flushing while the other writes) are never lost: every write that
// returned before the final commit is in it.
func TestWritesRacingCommits(t *testing.T) {
	s := newTestStore(t, 16<<20)
	ctx := context.Background()
	const n = 2000
	s.put(t, "f", make([]byte, n))
	d := s.edit(t, "f")
	defer d.Close()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
				errs <- err
				return
			}
		}
	})
	want := make([]byte, n)
	for i := range n {
		want[i] = byte(i%250) + 1
		if _, err := d.WriteAt(ctx, want[i:i+1], uint64(i)); err != nil {
			t.Fatal(err)
		}
	}
	close(stop)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if _, err := d.Commit(ctx, store.CommitOptions{Key: "f"}); err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "after racing commits", s.read(t, "f"), want)
	d.Close()
	if u := s.used(); u != roundUp(n) {
		t.Fatalf("Used = %d, want %d", u, roundUp(n))
	}
}

// Several drafts of one key commit concurrently, last committer wins; a
// reader always sees one whole version, and nothing leaks.
func TestConcurrentCommitsAndReaders(t *testing.T) {
	s := newTestStore(t, 32<<20, withSegments(3), noEvict())
	ctx := context.Background()
	const writers, commits, readers = 4, 30, 4
	// Version v of the file is size(v) bytes of byte v.
	size := func(v byte) int { return 1000 + int(v)*997 }
	version := func(w, i int) byte { return byte(1 + w*commits + i) }
	s.put(t, "f", bytes.Repeat([]byte{0xFF}, size(0xFF)))
	var wg sync.WaitGroup
	errs := make(chan error, writers+readers)
	stop := make(chan struct{})
	for w := range writers {
		wg.Go(func() {
			for i := range commits {
				v := version(w, i)
				d := s.NewDraft(store.NewIno(), nil, true)
				_, err := d.WriteAt(ctx, bytes.Repeat([]byte{v}, size(v)), 0)
				if err == nil {
					_, err = d.Commit(ctx, store.CommitOptions{Key: "f"})
				}
				d.Close()
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	var rwg sync.WaitGroup
	for range readers {
		rwg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				r, err := s.OpenReader(ctx, "f")
				if err != nil {
					errs <- err
					return
				}
				b, err := readAll(r)
				r.Close()
				if err != nil {
					errs <- err
					return
				}
				v := b[0]
				if len(b) != size(v) || !bytes.Equal(b, bytes.Repeat([]byte{v}, len(b))) {
					errs <- fmt.Errorf("reader saw a torn version: %d B starting with %d", len(b), v)
					return
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	rwg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	last := s.read(t, "f")
	if u := s.used(); u != roundUp(uint64(len(last))) {
		t.Fatalf("Used = %d, want %d for the last version", u, roundUp(uint64(len(last))))
	}
	if st := s.Stats(); st.OpenObjects != 0 {
		t.Fatalf("OpenObjects = %d", st.OpenObjects)
	}
	s.checkAlloc(t)
}

// TestSizeDuringCommit: Size and Dirty answer while a commit waits in the
// index (an etcd transaction, in a cluster), so a stat of a file being
// committed does not wait for it.
func TestSizeDuringCommit(t *testing.T) {
	entered, release := make(chan struct{}), make(chan struct{})
	x := &raceIndex{Index: store.NewEmbedded()}
	x.hook = func() {
		close(entered)
		<-release
	}
	s := newTestStore(t, 4<<20, withIndex(x))
	ctx := context.Background()
	d := s.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	if _, err := d.WriteAt(ctx, pattern(1, 5000), 0); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := d.Commit(ctx, store.CommitOptions{Key: "f"})
		done <- err
	}()
	<-entered
	answered := make(chan struct{})
	go func() {
		if n, dirty := d.Size(), d.Dirty(); n != 5000 || !dirty {
			t.Errorf("during the commit: size %d, dirty %v; want 5000, true", n, dirty)
		}
		close(answered)
	}()
	select {
	case <-answered:
	case <-time.After(20 * time.Second):
		t.Error("Size/Dirty blocked behind a commit waiting in the index")
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if d.Dirty() || d.Size() != 5000 {
		t.Fatalf("after the commit: size %d, dirty %v", d.Size(), d.Dirty())
	}
}

// TestConcurrentCommitsOfOneKey: two drafts of one key commit over each
// other again and again (O_TRUNC rewriters do), with the index slow to
// return from a swap that landed, so one commit replaces the other's
// version before that one has recorded it. Every version read is whole,
// and once the key is removed all its space is back.
func TestConcurrentCommitsOfOneKey(t *testing.T) {
	idx := store.NewEmbedded()
	t.Cleanup(func() { _ = idx.Close() })
	s := newTestStore(t, 8<<20, noEvict(), withIndex(lateSwaps{idx, time.Millisecond}))
	ctx := context.Background()
	o := s.put(t, "k", pattern(0, 1000))
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 {
				d, err := s.OpenDraft(ctx, "k", o.Ino, true)
				if err != nil {
					t.Error(err)
					return
				}
				// Two extents at least: a stale body would show past the first.
				// Lengths differ widely (so do the extent lists) and tell
				// the reader the seed.
				n := w*100 + i
				data := pattern(byte(1+n), 300<<10+n*4099)
				if _, err := d.WriteAt(ctx, data, 0); err != nil {
					t.Error(err)
				}
				if _, err := d.Commit(ctx, store.CommitOptions{Key: "k", IfIno: o.Ino}); err != nil {
					t.Error(err)
				}
				d.Close()
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range 300 {
			b := s.read(t, "k")
			if len(b) < 300<<10 && len(b) != 1000 {
				t.Errorf("read %d B", len(b))
				return
			}
			if n := (len(b) - 300<<10) / 4099; len(b) > 1000 && !bytes.Equal(b, pattern(byte(1+n), len(b))) {
				t.Errorf("torn version of %d B", len(b))
				return
			}
		}
	}()
	wg.Wait()
	if err := s.Delete(ctx, "k", 0); err != nil {
		t.Fatal(err)
	}
	if u := s.used(); u != 0 {
		t.Errorf("%d B still used after the key is gone", u)
	}
	s.checkAlloc(t)
}

// lateSwaps returns from half its compare-and-swaps late, after they
// landed.
type lateSwaps struct {
	store.Index
	delay time.Duration
}

func (x lateSwaps) CompareAndSwap(ctx context.Context, swaps ...store.Swap) (uint64, error) {
	v, err := x.Index.CompareAndSwap(ctx, swaps...)
	// Only some: a late one must be overtaken by a prompt one.
	time.Sleep(time.Duration(rand.IntN(2)) * x.delay)
	return v, err
}

// TestCommitLast: a last commit publishes like any and closes the draft,
// holding nothing of the new version; a replace by a last commit frees
// the old body at once; a failed one leaves the draft open.
func TestCommitLast(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	put := func(data []byte, o store.CommitOptions) (*store.Draft, *store.Object, error) {
		d := s.NewDraft(o.Template.Ino, nil, true)
		if _, err := d.WriteAt(ctx, data, 0); err != nil {
			t.Fatal(err)
		}
		obj, err := d.Commit(ctx, o)
		return d, obj, err
	}
	ino := store.NewIno()
	one, two := pattern(1, 10_000), pattern(2, 20_000)
	d, o, err := put(one, store.CommitOptions{Key: "f", Template: &store.Object{Ino: ino, Mode: 0o600}, Last: true})
	if err != nil || o.Size != uint64(len(one)) {
		t.Fatalf("commit: %+v, %v", o, err)
	}
	if _, err := d.WriteAt(ctx, []byte("x"), 0); !errors.Is(err, store.ErrClosed) {
		t.Fatalf("write after a last commit: %v, want ErrClosed", err)
	}
	d.Close() // closing again is harmless
	if s.IsOpen(ino) {
		t.Fatal("a last commit left its inode open")
	}
	equalBytes(t, "committed", s.read(t, "f"), one)
	d, _, err = put(two, store.CommitOptions{Key: "f", Template: &store.Object{Ino: ino}, IfVersion: o.Version, Last: true})
	if err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "replaced", s.read(t, "f"), two)
	if got, want := s.used(), roundUp(uint64(len(two))); got != want {
		t.Fatalf("used %d after the replace, want %d: the old body is held", got, want)
	}
	d, _, err = put(one, store.CommitOptions{Key: "f", Template: &store.Object{Ino: ino}, Exclusive: true, Last: true})
	if !errors.Is(err, store.ErrExists) {
		t.Fatalf("exclusive over an existing key: %v", err)
	}
	if _, err := d.WriteAt(ctx, []byte("y"), 0); err != nil {
		t.Fatalf("a failed last commit closed the draft: %v", err)
	}
	d.Close()
	if got, want := s.used(), roundUp(uint64(len(two))); got != want {
		t.Fatalf("used %d after closing the failed draft, want %d", got, want)
	}
	s.checkAlloc(t)
}

// TestDraftWriteStaged: another process's memory (here this one's, by
// address) staged in pieces lands whole at its offset, pieces across the
// stage's size included; an address that faults fails the write and the
// draft, as WriteFrom's do. (That nothing of the draft is held while the
// memory is read is tested end to end: tests.TestIoctlMappedUpdate.)
func TestDraftWriteStaged(t *testing.T) {
	s := newTestStore(t, 32<<20)
	ctx := context.Background()
	base := pattern(1, 100)
	s.put(t, "f", base)
	d := s.edit(t, "f")
	defer d.Close()
	src := pattern(2, 9<<20+77) // more than two stage pieces
	buf := transfer.VMBuffer(os.Getpid(), uint64(uintptr(unsafe.Pointer(&src[0]))), uint64(len(src)))
	if n, err := d.WriteStaged(ctx, buf, 50); err != nil || n != uint64(len(src)) {
		t.Fatalf("WriteStaged: %d, %v", n, err)
	}
	runtime.KeepAlive(src)
	o, err := d.Commit(ctx, store.CommitOptions{Key: "f"})
	if err != nil {
		t.Fatal(err)
	}
	want := append(append([]byte(nil), base[:50]...), src...)
	if got := s.read(t, "f"); !bytes.Equal(got, want) || o.Size != uint64(len(want)) {
		t.Fatalf("after the staged write: %d B (size %d), want %d", len(got), o.Size, len(want))
	}
	d = s.edit(t, "f")
	defer d.Close()
	if _, err := d.WriteStaged(ctx, transfer.VMBuffer(os.Getpid(), 8, 4096), 0); !errors.Is(err, transfer.ErrFault) {
		t.Fatalf("staged write of an unmapped address: %v", err)
	}
	if d.Err() == nil {
		t.Fatal("a failed staged write left the draft able to commit")
	}
}

// TestKillSUID: KillSUID clears the set-user-ID bit, and the
// set-group-ID bit only where the group may execute; a batch put and a
// one-shot commit with the option clear them on the version they
// replace, and a new key keeps its template's mode.
func TestKillSUID(t *testing.T) {
	for mode, want := range map[uint32]uint32{0o6777: 0o777, 0o6767: 0o2767, 0o4755: 0o755, 0o2750: 0o750, 0o755: 0o755} {
		if got := store.KillSUID(mode); got != want {
			t.Errorf("KillSUID(%o) = %o, want %o", mode, got, want)
		}
	}
	s := newTestStore(t, 1<<20)
	ctx := context.Background()
	chmod := func(key string, mode uint32) {
		t.Helper()
		if _, err := s.Update(ctx, key, 0, func(o *store.Object) error { o.Mode = mode; return nil }); err != nil {
			t.Fatal(err)
		}
	}
	modeOf := func(key string) uint32 {
		t.Helper()
		o, err := s.Stat(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return o.Mode
	}
	s.put(t, "f", []byte("old"))
	chmod("f", 0o6777)
	// Without the option (a privileged writer's commit): kept.
	s.put(t, "f", []byte("root"))
	if m := modeOf("f"); m != 0o6777 {
		t.Fatalf("after a privileged commit: mode %o, want 6777", m)
	}
	// A batch put and a one-shot commit, by option; a new key keeps its
	// template's mode.
	cur, err := s.Stat(ctx, "f")
	if err != nil {
		t.Fatal(err)
	}
	specs := []store.PutSpec{
		{Key: "f", Cur: cur, Bufs: []transfer.Buffer{transfer.HostBuffer([]byte("batch"))}, Place: store.DefaultPlacement(), KillSUID: true},
		{Key: "g", Bufs: []transfer.Buffer{transfer.HostBuffer([]byte("new"))}, Place: store.DefaultPlacement(), KillSUID: true,
			Template: store.Object{Mode: 0o4755, Ino: store.NewIno()}},
	}
	if _, errs := s.StartPuts(ctx, specs).Commit(); errs[0] != nil || errs[1] != nil {
		t.Fatal(errs)
	}
	if m, g := modeOf("f"), modeOf("g"); m != 0o777 || g != 0o4755 {
		t.Fatalf("batch put: modes %o and %o, want 777 and 4755", m, g)
	}
	chmod("f", 0o6777)
	one := s.NewDraft(cur.Ino, nil, true)
	defer one.Close()
	if _, err := one.WriteAt(ctx, []byte("one"), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := one.Commit(ctx, store.CommitOptions{Key: "f", KillSUID: true}); err != nil {
		t.Fatal(err)
	}
	if m := modeOf("f"); m != 0o777 {
		t.Fatalf("one-shot commit: mode %o, want 777", m)
	}
}

// RebaseOnto moves a draft without changes of its own onto the version a
// writer of its own published since it began, and leaves one with
// changes, or one whose key holds another file, as it is.
func TestDraftRebase(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	o := s.put(t, "f", []byte("old\n"))
	shared, err := s.OpenDraft(ctx, "f", o.Ino, false)
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	if rebaseAt(t, s, shared, "f") {
		t.Fatal("rebased onto the version it began from")
	}
	rewrite := func(data string) {
		t.Helper()
		d, err := s.OpenDraft(ctx, "f", o.Ino, true)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		if _, err := d.WriteAt(ctx, []byte(data), 0); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Commit(ctx, store.CommitOptions{Key: "f", IfIno: o.Ino}); err != nil {
			t.Fatal(err)
		}
	}
	rewrite("NEWER\n")
	if !rebaseAt(t, s, shared, "f") {
		t.Fatal("a clean draft did not move onto the new version")
	}
	if got := string(readDraft(t, shared)); got != "NEWER\n" || shared.Size() != 6 {
		t.Fatalf("rebased draft holds %q (size %d)", got, shared.Size())
	}
	if _, err := shared.WriteAt(ctx, []byte("X"), 0); err != nil {
		t.Fatal(err)
	}
	rewrite("v3\n")
	if rebaseAt(t, s, shared, "f") {
		t.Fatal("a draft with changes of its own was rebased")
	}
	if got := string(readDraft(t, shared)); got != "XEWER\n" {
		t.Fatalf("draft with changes holds %q", got)
	}
	// Another file at the key: nothing to follow.
	other, err := s.OpenDraft(ctx, "f", o.Ino, false)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	if err := s.Delete(ctx, "f", 0); err != nil {
		t.Fatal(err)
	}
	s.put(t, "f", []byte("another file\n"))
	if rebaseAt(t, s, other, "f") {
		t.Fatal("rebased onto another file")
	}
}

// An append through a clean draft that a rewrite moves meanwhile
// (RebaseOnto) lands at the end of one version or the other: after the old
// version's bytes (the append came first, and the draft keeps it) or
// after the new one's, never at the old end inside the new bytes, nor
// past the new end with zeros between.
func TestDraftAppendDuringRebase(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	for i := range 300 {
		short, long := "old\n", strings.Repeat("new version\n", 1+i%7)
		if i%2 == 1 {
			short, long = long, short // the rewrite shrinks the file
		}
		o := s.put(t, "f", []byte(short))
		shared, err := s.OpenDraft(ctx, "f", o.Ino, false)
		if err != nil {
			t.Fatal(err)
		}
		d, err := s.OpenDraft(ctx, "f", o.Ino, true)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.WriteAt(ctx, []byte(long), 0); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Commit(ctx, store.CommitOptions{Key: "f", IfIno: o.Ino}); err != nil {
			t.Fatal(err)
		}
		d.Close()
		var wg sync.WaitGroup
		wg.Go(func() {
			if _, _, err := shared.AppendFrom(ctx, transfer.HostBuffer([]byte("A\n"))); err != nil {
				t.Error(err)
			}
		})
		rebaseAt(t, s, shared, "f")
		wg.Wait()
		if got := string(readDraft(t, shared)); got != short+"A\n" && got != long+"A\n" {
			t.Fatalf("round %d: the draft holds %q, want %q or %q", i, got, short+"A\n", long+"A\n")
		}
		shared.Close()
		if err := s.Delete(ctx, "f", 0); err != nil {
			t.Fatal(err)
		}
	}
}

// An append racing a truncation of its draft lands at the end as it is
// before the truncation or after it: the truncation cuts it, or it
// follows the cut bytes; never past the cut with zeros between.
func TestDraftAppendDuringTruncate(t *testing.T) {
	s := newTestStore(t, 4<<20)
	ctx := context.Background()
	o := s.put(t, "f", []byte("0123456789"))
	for i := range 300 {
		shared, err := s.OpenDraft(ctx, "f", o.Ino, false)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Go(func() {
			if _, _, err := shared.AppendFrom(ctx, transfer.HostBuffer([]byte("AB"))); err != nil {
				t.Error(err)
			}
		})
		if err := shared.Truncate(ctx, 4); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		if got := string(readDraft(t, shared)); got != "0123AB" && got != "0123" {
			t.Fatalf("round %d: the draft holds %q, want \"0123AB\" or \"0123\"", i, got)
		}
		shared.Close()
	}
}

// rebaseAt rebases d onto key's current version, as the daemon does once
// it found the draft's file: false when key holds nothing.
func rebaseAt(t *testing.T, s *testStore, d *store.Draft, key string) bool {
	t.Helper()
	r, err := s.OpenReader(context.Background(), key)
	if err != nil {
		return false
	}
	return d.RebaseOnto(r)
}
