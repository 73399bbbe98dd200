package store_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// garbage fills fresh segment memory, so that a read of bytes that were
// never written or zeroed shows up as 0xA5 instead of passing as zeros.
const garbage = 0xA5

// testStore is a Store over real segments of plain heap memory, with the
// parts a test inspects.
type testStore struct {
	*store.Store
	Table *segment.Table
	Index store.Index
	Eng   *transfer.Engine
}

type testConfig struct {
	segments int // the size is split evenly among this many segments
	opts     store.Options
	index    store.Index
	engine   transfer.Options
}

type testOpt func(*testConfig)

// withSegments splits the store's memory into n segments.
func withSegments(n int) testOpt { return func(c *testConfig) { c.segments = n } }

// withOptions edits the store options (Index, Segments and Engine are set
// by newTestStore unless withIndex is given).
func withOptions(fn func(*store.Options)) testOpt { return func(c *testConfig) { fn(&c.opts) } }

// noEvict turns eviction off.
func noEvict() testOpt { return withOptions(func(o *store.Options) { o.Evict = false }) }

// withIndex runs the store over x (e.g. a fault-injecting wrapper).
func withIndex(x store.Index) testOpt { return func(c *testConfig) { c.index = x } }

// withSmallCopies makes the engine split every batch over 64 KiB across
// its workers in 4 KiB chunks, so tests exercise the worker path.
func withSmallCopies() testOpt {
	return func(c *testConfig) {
		c.engine.Workers, c.engine.SplitBytes, c.engine.ChunkBytes = 4, 64<<10, 4096
	}
}

// newTestStore returns a store over size bytes of memory (a multiple of
// segment.Granule per segment), eviction on with the default watermarks
// unless opts say otherwise. Everything is closed when the test ends.
func newTestStore(t testing.TB, size int, opts ...testOpt) *testStore {
	t.Helper()
	c := testConfig{segments: 1, opts: store.DefaultOptions()}
	c.opts.Now = nil
	for _, o := range opts {
		o(&c)
	}
	table := segment.NewTable()
	for i := range c.segments {
		mem := bytes.Repeat([]byte{garbage}, size/c.segments)
		if err := table.Add(segment.NewSegment(segment.ID(i+1), mem)); err != nil {
			t.Fatal(err)
		}
	}
	c.engine.Local = table
	c.engine.Self, c.engine.Remote = c.opts.Node, c.opts.Transport
	eng, err := transfer.New(c.engine)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(eng.Close)
	if c.index == nil {
		c.index = store.NewEmbedded()
	}
	t.Cleanup(func() { _ = c.index.Close() })
	c.opts.Index, c.opts.Segments, c.opts.Engine = c.index, table, eng
	s, err := store.New(c.opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return &testStore{Store: s, Table: table, Index: c.index, Eng: eng}
}

// used returns the bytes allocated in the store's segments.
func (s *testStore) used() uint64 { return s.Table.Stats().Used }

// checkAlloc verifies every segment allocator's invariants.
func (s *testStore) checkAlloc(t testing.TB) {
	t.Helper()
	for _, seg := range s.Table.Segments() {
		if err := seg.Alloc.Check(); err != nil {
			t.Fatalf("seg%d: %v", seg.ID, err)
		}
	}
}

// roundUp rounds n up to the allocation granule.
func roundUp(n uint64) uint64 {
	return (n + segment.Granule - 1) / segment.Granule * segment.Granule
}

// pattern returns n bytes that differ from garbage, zero and each other's
// shifts: a byte depends on its offset and on seed.
func pattern(seed byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7+i/251) ^ seed
		if b[i] == 0 || b[i] == garbage {
			b[i] = seed | 1
		}
	}
	return b
}

// put writes data to key through a truncating draft and commits it.
func (s *testStore) put(t testing.TB, key string, data []byte) *store.Object {
	t.Helper()
	o, err := s.tryPut(key, data)
	if err != nil {
		t.Fatalf("put %q (%d B): %v", key, len(data), err)
	}
	return o
}

func (s *testStore) tryPut(key string, data []byte) (*store.Object, error) {
	ctx := context.Background()
	d := s.NewDraft(store.NewIno(), nil, true)
	defer d.Close()
	if len(data) > 0 {
		if _, err := d.WriteAt(ctx, data, 0); err != nil {
			return nil, err
		}
	}
	return d.Commit(ctx, store.CommitOptions{Key: key})
}

// putSeries puts n keys prefix0, prefix1, ... of size bytes each (key i
// holds pattern(i, size)) and returns them in order.
func (s *testStore) putSeries(t testing.TB, prefix string, n, size int) []string {
	t.Helper()
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s%d", prefix, i)
		s.put(t, keys[i], pattern(byte(i), size))
	}
	return keys
}

// edit opens a copy-on-write draft on the current version of key, like
// open(2) without O_TRUNC.
func (s *testStore) edit(t testing.TB, key string) *store.Draft {
	t.Helper()
	r, err := s.OpenReader(context.Background(), key)
	if err != nil {
		t.Fatalf("open %q: %v", key, err)
	}
	return s.NewDraft(r.Object().Ino, r, false)
}

// read returns the whole current content of key.
func (s *testStore) read(t testing.TB, key string) []byte {
	t.Helper()
	b, err := s.tryRead(key)
	if err != nil {
		t.Fatalf("read %q: %v", key, err)
	}
	return b
}

func (s *testStore) tryRead(key string) ([]byte, error) {
	r, err := s.OpenReader(context.Background(), key)
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return readAll(r)
}

// readAll reads everything a reader holds, checking that ReadAt and Slices
// agree.
func readAll(r *store.Reader) ([]byte, error) {
	b := make([]byte, r.Size())
	n, err := r.ReadAt(context.Background(), b, 0)
	if err != nil {
		return nil, err
	}
	if uint64(n) != r.Size() {
		return nil, fmt.Errorf("ReadAt returned %d of %d B", n, r.Size())
	}
	sl, err := r.Slices(0, r.Size())
	if err != nil {
		return nil, err
	}
	if joined := bytes.Join(sl, nil); !bytes.Equal(joined, b) {
		return nil, errors.New("Slices and ReadAt disagree")
	}
	return b, nil
}

// readDraft returns the whole content of a draft.
func readDraft(t testing.TB, d *store.Draft) []byte {
	t.Helper()
	b := make([]byte, d.Size())
	n, err := d.ReadAt(context.Background(), b, 0)
	if err != nil || n != len(b) {
		t.Fatalf("draft ReadAt: %d of %d B, %v", n, len(b), err)
	}
	return b
}

// equalBytes reports the first difference between got and want.
func equalBytes(t testing.TB, what string, got, want []byte) {
	t.Helper()
	if bytes.Equal(got, want) {
		return
	}
	if len(got) != len(want) {
		t.Fatalf("%s: %d B, want %d B", what, len(got), len(want))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("%s: byte %d is %#x, want %#x (%d B)", what, i, got[i], want[i], len(got))
		}
	}
}

func wantErr(t testing.TB, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Fatalf("%s: %v, want %v", what, err, want)
	}
}

// mkdirAll makes the explicit directories above key.
func (s *testStore) mkdirAll(t testing.TB, key string) {
	t.Helper()
	for i := range key {
		if key[i] != '/' {
			continue
		}
		if _, err := s.Mkdir(context.Background(), key[:i], nil); err != nil && !errors.Is(err, store.ErrExists) {
			t.Fatalf("mkdir %q: %v", key[:i], err)
		}
	}
}

// makeImplicit removes the object of directory dir from the index, leaving
// its children: an implicit directory, as keys written into a shared index
// by another client (put or etcd) leave them.
func (s *testStore) makeImplicit(t testing.TB, dir string) {
	t.Helper()
	ctx := context.Background()
	o, err := s.Index.Get(ctx, dir)
	if err != nil {
		t.Fatal(err)
	}
	if o.Kind != store.KindDir {
		t.Fatalf("%q is not a directory", dir)
	}
	if _, err := s.Index.CompareAndSwap(ctx, store.Swap{Key: dir, Old: o.Version}); err != nil {
		t.Fatal(err)
	}
	if st, err := s.Stat(ctx, dir); err != nil || st.Version != 0 || st.Kind != store.KindDir {
		t.Fatalf("Stat(%q) = %+v, %v; want an implicit directory", dir, st, err)
	}
}
