package store_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mooncake-fs/mooncake-fs/store"
)

var (
	seedFlag = flag.Uint64("seed", 0, "seed of TestModel (0: a new one each run)")
	opsFlag  = flag.Int("ops", 1500, "operations per TestModel run")
)

// TestModel runs random operations on a few keys and checks every result
// against a map of committed contents. At the end, with everything closed,
// the segments must hold exactly the committed objects: nothing leaked,
// nothing freed twice (-tags invariants panics on that).
func TestModel(t *testing.T) {
	base := *seedFlag
	runs := 4
	if base == 0 {
		base = uint64(time.Now().UnixNano())
	} else {
		runs = 1
	}
	for i := range uint64(runs) {
		seed := base + i
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			m := newModel(t, seed)
			t.Cleanup(func() {
				if t.Failed() {
					t.Logf("last operations:\n  %s", strings.Join(m.history, "\n  "))
					t.Logf("reproduce with: go test ./store -run 'TestModel' -seed=%d", seed)
				}
			})
			m.run(*opsFlag)
		})
	}
}

const (
	modelKeys    = 5
	modelMaxSize = 600 << 10 // beyond the first reservation: multi-extent objects
	modelMaxIO   = 70 << 10
)

type mDraft struct {
	d    *store.Draft
	key  string
	data []byte
	// pristine: started from a non-empty committed version (or committed
	// a non-empty one) and unchanged since, so Commit publishes nothing.
	pristine bool
}

type mReader struct {
	r    *store.Reader
	key  string
	data []byte
}

type mHold struct {
	release func()
	slices  [][]byte
	want    []byte
}

type model struct {
	t         *testing.T
	rng       *rand.Rand
	s         *testStore
	ctx       context.Context
	committed map[string][]byte
	drafts    []*mDraft
	readers   []*mReader
	holds     []*mHold
	history   []string
}

func newModel(t *testing.T, seed uint64) *model {
	s := newTestStore(t, 32<<20, withSegments(2), noEvict(), withSmallCopies())
	m := &model{t: t, rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)), s: s,
		ctx: context.Background(), committed: map[string][]byte{}}
	if _, err := s.Mkdir(m.ctx, "d", nil); err != nil {
		t.Fatal(err)
	}
	return m
}

func (m *model) logf(format string, args ...any) {
	m.history = append(m.history, fmt.Sprintf(format, args...))
	if len(m.history) > 40 {
		m.history = m.history[1:]
	}
}

func (m *model) fatalf(format string, args ...any) {
	m.t.Helper()
	m.t.Fatalf(format, args...)
}

func (m *model) key() string { return fmt.Sprintf("d/k%d", m.rng.IntN(modelKeys)) }

func (m *model) bytes(n int) []byte {
	b := make([]byte, n)
	for i := 0; i < n; i += 8 {
		v := m.rng.Uint64()
		for j := i; j < min(i+8, n); j++ {
			b[j] = byte(v)
			v >>= 8
		}
	}
	return b
}

// ioLen picks a length, often small or next to a granule boundary.
func (m *model) ioLen() int {
	switch m.rng.IntN(4) {
	case 0:
		return 1 + m.rng.IntN(100)
	case 1:
		return 4096 + m.rng.IntN(3) - 1
	default:
		return 1 + m.rng.IntN(modelMaxIO)
	}
}

// offset picks a write or truncate position relative to a size.
func (m *model) offset(size, n int) int {
	switch m.rng.IntN(5) {
	case 0:
		return 0
	case 1:
		return size // append
	case 2:
		return m.rng.IntN(size + 1)
	default: // anywhere, often past the end
		return m.rng.IntN(modelMaxSize - n + 1)
	}
}

func resize(b []byte, n int) []byte {
	if n <= len(b) {
		return b[:n:n]
	}
	return append(b, make([]byte, n-len(b))...)
}

func (m *model) run(ops int) {
	for i := range ops {
		switch op := m.rng.IntN(100); {
		case op < 12:
			m.newDraft()
		case op < 35:
			m.write()
		case op < 41:
			m.truncate()
		case op < 46:
			m.readDraft()
		case op < 58:
			m.commit()
		case op < 63:
			m.closeDraft()
		case op < 67:
			m.delete()
		case op < 72:
			m.rename()
		case op < 79:
			m.openReader()
		case op < 84:
			m.readReader()
		case op < 88:
			m.closeReader()
		case op < 91:
			m.hold()
		case op < 93:
			m.releaseHold()
		default:
			m.readCommitted(m.key())
		}
		if i%100 == 99 {
			m.checkAll()
		}
	}
	m.finish()
}

func (m *model) newDraft() {
	if len(m.drafts) >= 4 {
		return
	}
	key, trunc := m.key(), m.rng.IntN(3) == 0
	cur, ok := m.committed[key]
	md := &mDraft{key: key}
	if ok {
		r, err := m.s.OpenReader(m.ctx, key)
		if err != nil {
			m.fatalf("open %s for a draft: %v", key, err)
		}
		md.d = m.s.NewDraft(r.Object().Ino, r, trunc)
		if !trunc {
			md.data = bytes.Clone(cur)
			md.pristine = len(cur) > 0
		}
	} else {
		md.d = m.s.NewDraft(store.NewIno(), nil, trunc)
	}
	m.logf("draft %d on %s (exists %v, trunc %v, %d B)", len(m.drafts), key, ok, trunc, len(md.data))
	m.drafts = append(m.drafts, md)
}

func (m *model) pickDraft() (int, *mDraft) {
	if len(m.drafts) == 0 {
		return -1, nil
	}
	i := m.rng.IntN(len(m.drafts))
	return i, m.drafts[i]
}

func (m *model) write() {
	i, md := m.pickDraft()
	if md == nil {
		return
	}
	n := m.ioLen()
	off := m.offset(len(md.data), n)
	p := m.bytes(n)
	m.logf("draft %d (%s): write %d B at %d (size %d)", i, md.key, n, off, len(md.data))
	if got, err := md.d.WriteAt(m.ctx, p, uint64(off)); err != nil || got != n {
		m.fatalf("draft %d: WriteAt(%d B at %d) = %d, %v", i, n, off, got, err)
	}
	md.data = resize(md.data, max(len(md.data), off+n))
	copy(md.data[off:], p)
	md.pristine = false
	if md.d.Size() != uint64(len(md.data)) {
		m.fatalf("draft %d: size %d, want %d", i, md.d.Size(), len(md.data))
	}
}

func (m *model) truncate() {
	i, md := m.pickDraft()
	if md == nil {
		return
	}
	size := m.offset(len(md.data), 0)
	if m.rng.IntN(4) == 0 {
		size = m.rng.IntN(len(md.data) + 1) // down more often
	}
	m.logf("draft %d (%s): truncate %d -> %d", i, md.key, len(md.data), size)
	if err := md.d.Truncate(m.ctx, uint64(size)); err != nil {
		m.fatalf("draft %d: Truncate(%d): %v", i, size, err)
	}
	if size != len(md.data) {
		md.pristine = false
	}
	md.data = resize(md.data, size)
}

func (m *model) readDraft() {
	i, md := m.pickDraft()
	if md == nil {
		return
	}
	off, n := m.rng.IntN(len(md.data)+10), m.ioLen()
	m.logf("draft %d (%s): read %d B at %d (size %d)", i, md.key, n, off, len(md.data))
	buf := make([]byte, n)
	got, err := md.d.ReadAt(m.ctx, buf, uint64(off))
	if err != nil {
		m.fatalf("draft %d: ReadAt: %v", i, err)
	}
	want := md.data[min(off, len(md.data)):min(off+n, len(md.data))]
	if !bytes.Equal(buf[:got], want) {
		m.fatalf("draft %d (%s): ReadAt(%d B at %d) = %d B, model %d B, first difference at %d", i, md.key, n, off, got, len(want), firstDiffAt(buf[:got], want))
	}
}

func (m *model) commit() {
	i, md := m.pickDraft()
	if md == nil {
		return
	}
	m.logf("draft %d: commit %s (%d B, pristine %v)", i, md.key, len(md.data), md.pristine)
	o, err := md.d.Commit(m.ctx, store.CommitOptions{Key: md.key})
	if err != nil {
		m.fatalf("draft %d: Commit(%s): %v", i, md.key, err)
	}
	if md.pristine {
		return // unchanged since its base: nothing published
	}
	if o.Size != uint64(len(md.data)) || o.Key != md.key {
		m.fatalf("draft %d: committed %+v, want %s with %d B", i, o, md.key, len(md.data))
	}
	m.committed[md.key] = bytes.Clone(md.data)
	md.pristine = len(md.data) > 0
	if md.d.Dirty() {
		m.fatalf("draft %d dirty after its commit", i)
	}
}

func (m *model) closeDraft() {
	i, md := m.pickDraft()
	if md == nil {
		return
	}
	m.logf("draft %d (%s): close", i, md.key)
	md.d.Close()
	m.drafts = slices.Delete(m.drafts, i, i+1)
}

func (m *model) delete() {
	key := m.key()
	err := m.s.Delete(m.ctx, key, 0)
	m.logf("delete %s: %v", key, err)
	if _, ok := m.committed[key]; !ok {
		if !errors.Is(err, store.ErrNotFound) {
			m.fatalf("delete of missing %s: %v", key, err)
		}
		return
	}
	if err != nil {
		m.fatalf("delete %s: %v", key, err)
	}
	delete(m.committed, key)
}

func (m *model) rename() {
	src, dst := m.key(), m.key()
	var flags uint32
	if m.rng.IntN(3) == 0 {
		flags = store.RenameNoReplace
	}
	err := m.s.Rename(m.ctx, src, dst, flags)
	m.logf("rename %s -> %s (flags %d): %v", src, dst, flags, err)
	data, ok := m.committed[src]
	_, dstOK := m.committed[dst]
	var want error
	switch {
	case src == dst:
	case !ok:
		want = store.ErrNotFound
	case dstOK && flags&store.RenameNoReplace != 0:
		want = store.ErrExists
	}
	if !errors.Is(err, want) || (want == nil) != (err == nil) {
		m.fatalf("rename %s -> %s: %v, want %v", src, dst, err, want)
	}
	if err == nil && src != dst {
		m.committed[dst] = data
		delete(m.committed, src)
	}
}

func (m *model) openReader() {
	if len(m.readers) >= 6 {
		return
	}
	key := m.key()
	r, err := m.s.OpenReader(m.ctx, key)
	m.logf("open reader %d on %s: %v", len(m.readers), key, err)
	data, ok := m.committed[key]
	if !ok {
		if !errors.Is(err, store.ErrNotFound) {
			m.fatalf("open of missing %s: %v", key, err)
		}
		return
	}
	if err != nil {
		m.fatalf("open %s: %v", key, err)
	}
	if r.Size() != uint64(len(data)) {
		m.fatalf("reader on %s: size %d, want %d", key, r.Size(), len(data))
	}
	m.readers = append(m.readers, &mReader{r: r, key: key, data: data})
}

func (m *model) pickReader() (int, *mReader) {
	if len(m.readers) == 0 {
		return -1, nil
	}
	i := m.rng.IntN(len(m.readers))
	return i, m.readers[i]
}

func (m *model) readReader() {
	i, mr := m.pickReader()
	if mr == nil {
		return
	}
	off, n := m.rng.IntN(len(mr.data)+10), m.ioLen()
	m.logf("reader %d (%s): read %d B at %d", i, mr.key, n, off)
	buf := make([]byte, n)
	got, err := mr.r.ReadAt(m.ctx, buf, uint64(off))
	if err != nil {
		m.fatalf("reader %d: ReadAt: %v", i, err)
	}
	want := mr.data[min(off, len(mr.data)):min(off+n, len(mr.data))]
	if !bytes.Equal(buf[:got], want) {
		m.fatalf("reader %d (%s): ReadAt(%d B at %d) = %d B, held version %d B, first difference at %d", i, mr.key, n, off, got, len(want), firstDiffAt(buf[:got], want))
	}
}

func (m *model) closeReader() {
	i, mr := m.pickReader()
	if mr == nil {
		return
	}
	m.logf("reader %d (%s): close", i, mr.key)
	mr.r.Close()
	m.readers = slices.Delete(m.readers, i, i+1)
}

func (m *model) hold() {
	i, mr := m.pickReader()
	if mr == nil || len(m.holds) >= 6 {
		return
	}
	off, n := m.rng.IntN(len(mr.data)+1), m.ioLen()
	sl, err := mr.r.Slices(uint64(off), uint64(n))
	if err != nil {
		m.fatalf("reader %d: Slices: %v", i, err)
	}
	m.logf("reader %d (%s): hold %d B at %d", i, mr.key, n, off)
	want := mr.data[min(off, len(mr.data)):min(off+n, len(mr.data))]
	m.holds = append(m.holds, &mHold{release: mr.r.Hold(), slices: sl, want: want})
}

func (m *model) releaseHold() {
	if len(m.holds) == 0 {
		return
	}
	i := m.rng.IntN(len(m.holds))
	h := m.holds[i]
	m.logf("release hold %d", i)
	if got := bytes.Join(h.slices, nil); !bytes.Equal(got, h.want) {
		m.fatalf("hold %d: held bytes changed (%d B, want %d B)", i, len(got), len(h.want))
	}
	h.release()
	m.holds = slices.Delete(m.holds, i, i+1)
}

func (m *model) readCommitted(key string) {
	got, err := m.s.tryRead(key)
	want, ok := m.committed[key]
	if !ok {
		if !errors.Is(err, store.ErrNotFound) {
			m.fatalf("read of missing %s: %v", key, err)
		}
		return
	}
	if err != nil {
		m.fatalf("read %s: %v", key, err)
	}
	if !bytes.Equal(got, want) {
		m.fatalf("read %s: %d B, model %d B, first difference at %d", key, len(got), len(want), firstDiffAt(got, want))
	}
}

// checkAll compares every key and the listing with the model.
func (m *model) checkAll() {
	var sum uint64
	for i := range modelKeys {
		key := fmt.Sprintf("d/k%d", i)
		m.readCommitted(key)
		sum += roundUp(uint64(len(m.committed[key])))
	}
	es, err := m.s.List(m.ctx, "d")
	if err != nil {
		m.fatalf("List: %v", err)
	}
	var names []string
	for _, e := range es {
		names = append(names, "d/"+e.Name)
		if uint64(len(m.committed["d/"+e.Name])) != e.Object.Size {
			m.fatalf("List: %s has size %d, model %d", e.Name, e.Object.Size, len(m.committed["d/"+e.Name]))
		}
	}
	if want := slices.Sorted(mapsKeys(m.committed)); !slices.Equal(names, want) {
		m.fatalf("List = %q, model has %q", names, want)
	}
	if u := m.s.used(); u < sum {
		m.fatalf("Used = %d, less than the committed %d B", u, sum)
	}
}

func (m *model) finish() {
	for _, h := range m.holds {
		if got := bytes.Join(h.slices, nil); !bytes.Equal(got, h.want) {
			m.fatalf("held bytes changed")
		}
		h.release()
	}
	for _, mr := range m.readers {
		mr.r.Close()
	}
	for _, md := range m.drafts {
		md.d.Close()
	}
	m.holds, m.readers, m.drafts = nil, nil, nil
	m.logf("closed everything")
	m.checkAll()
	var sum uint64
	for _, data := range m.committed {
		sum += roundUp(uint64(len(data)))
	}
	if u := m.s.used(); u != sum {
		m.fatalf("Used = %d with everything closed, want the committed %d B (%d keys): leak", u, sum, len(m.committed))
	}
	if st := m.s.Stats(); st.OpenObjects != 0 {
		m.fatalf("OpenObjects = %d with everything closed", st.OpenObjects)
	}
	m.s.checkAlloc(m.t)
	// Deleting everything leaves the segments empty.
	for key := range m.committed {
		if err := m.s.Delete(m.ctx, key, 0); err != nil {
			m.fatalf("delete %s: %v", key, err)
		}
	}
	if u := m.s.used(); u != 0 {
		m.fatalf("Used = %d after deleting everything", u)
	}
	m.s.checkAlloc(m.t)
}

// firstDiffAt returns the first offset at which a and b differ.
func firstDiffAt(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}
