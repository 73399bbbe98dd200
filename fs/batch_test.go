package fs

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/mooncake-fs/mooncake-fs/ioctl"
	"github.com/mooncake-fs/mooncake-fs/store"
	"github.com/mooncake-fs/mooncake-fs/transfer"
)

// runBatch runs one BATCH_PUT (or GET) of entries from this process's
// memory on the fixture's root and returns each entry's result.
func runBatch(t testing.TB, fx *fuzzFixture, put bool, entries []batchEntry) []int64 {
	t.Helper()
	return runBatchAs(t, fx, 0, put, entries)
}

// runBatchAs is runBatch by user uid (group uid too).
func runBatchAs(t testing.TB, fx *fuzzFixture, uid uint32, put bool, entries []batchEntry) []int64 {
	t.Helper()
	ctx := fuse.NewContext(context.Background(), &fuse.Caller{Owner: fuse.Owner{Uid: uid, Gid: uid}, Pid: uint32(os.Getpid())})
	if viaTable {
		return runTable(t, fx, ctx, put, entries)
	}
	a := ioctl.BatchArg{Source: ioctl.BatchVM}
	for _, e := range entries {
		be := ioctl.BatchEntry{Len: uint64(len(e.data)), ObjOff: e.off, Flags: e.flags}
		if len(e.data) > 0 {
			be.Addr = uint64(uintptr(unsafe.Pointer(&e.data[0])))
		}
		if _, err := a.AddKey(e.key, be); err != nil {
			t.Fatal(err)
		}
	}
	cmd := ioctl.CmdBatchGet
	if put {
		cmd = ioctl.CmdBatchPut
	}
	out := make([]byte, ioctl.Size(cmd))
	if _, errno := fx.root.Ioctl(ctx, fx.dh, cmd, 0, a.Marshal(), out); errno != 0 {
		t.Fatalf("batch: %v", errno)
	}
	if err := a.Unmarshal(out); err != nil {
		t.Fatal(err)
	}
	res := make([]int64, len(entries))
	for i := range res {
		res[i] = a.Entries[i].Result
	}
	runtime.KeepAlive(entries)
	return res
}

type batchEntry struct {
	key   string
	data  []byte
	off   uint64
	flags uint32
}

func readKey(t *testing.T, fx *fuzzFixture, key string) []byte {
	t.Helper()
	r, err := fx.st.OpenReader(context.Background(), key)
	if err != nil {
		t.Fatalf("open %s: %v", key, err)
	}
	defer r.Close()
	b := make([]byte, r.Size())
	if _, err := r.ReadAt(context.Background(), b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestBatchEntriesInOrder: entries take effect in order, flags or not,
// and an offset without FlagUpdate is refused, not dropped.
func TestBatchEntriesInOrder(t *testing.T) {
	fx := newFuzzFixture(t)
	res := runBatch(t, fx, true, []batchEntry{
		{key: "j", data: []byte("AAAA")},
		{key: "j", data: []byte("x"), off: 1, flags: ioctl.FlagUpdate},
		{key: "k", data: []byte("first")},
		{key: "k", data: []byte("second"), flags: ioctl.FlagExcl},
		{key: "o", data: []byte("hello"), off: 3},
	})
	want := []int64{4, 1, 5, -int64(syscall.EEXIST), -int64(syscall.EINVAL)}
	for i := range want {
		if res[i] != want[i] {
			t.Fatalf("results %v, want %v", res, want)
		}
	}
	if got := readKey(t, fx, "j"); string(got) != "AxAA" {
		t.Fatalf("j = %q, want the update applied after the put", got)
	}
	if got := readKey(t, fx, "k"); string(got) != "first" {
		t.Fatalf("k = %q", got)
	}
	if _, err := fx.st.Stat(context.Background(), "o"); err == nil {
		t.Fatal("the refused put made o")
	}
}

// TestBatchOverwriteNeedsNoDoubleSpace: a batch that rewrites keys using
// most of the store succeeds without room for both versions of them all.
func TestBatchOverwriteNeedsNoDoubleSpace(t *testing.T) {
	fx := newFuzzFixture(t) // 8 MiB, no eviction
	const n, size = 60, 96 << 10
	mk := func(seed byte) []batchEntry {
		es := make([]batchEntry, n)
		for i := range es {
			es[i] = batchEntry{key: fmt.Sprintf("v%02d", i), data: bytes.Repeat([]byte{seed + byte(i)}, size)}
		}
		return es
	}
	for round, seed := range []byte{1, 100} {
		es := mk(seed)
		for i, r := range runBatch(t, fx, true, es) {
			if r != size {
				t.Fatalf("round %d: key %d: %d", round, i, r)
			}
		}
		for _, e := range es {
			if !bytes.Equal(readKey(t, fx, e.key), e.data) {
				t.Fatalf("round %d: %s differs", round, e.key)
			}
		}
	}
	if st := fx.st.Stats(); st.Segments.Used > n*size+1<<20 || st.Reservations != 0 {
		t.Fatalf("after the rewrite: %+v", st)
	}
}

// TestChunkedBatches runs the batch model tests with every call cut into
// pipelined chunks, as calls with GPU buffers are.
func TestChunkedBatches(t *testing.T) {
	chunkAlways, chunkKeys = true, 8 // chunk boundaries every 8 keys
	t.Cleanup(func() { chunkAlways, chunkKeys = false, gpuChunkKeys })
	t.Run("vbatch-model", TestVBatchModel)
	t.Run("in-order", TestBatchEntriesInOrder)
	t.Run("overwrite", TestBatchOverwriteNeedsNoDoubleSpace)
	t.Run("many", func(t *testing.T) {
		// 60 keys, some twice, some failing at their commit: every chunk
		// boundary falls somewhere in them.
		fx := newFuzzFixture(t)
		model := map[string][]byte{}
		for round := range 3 {
			var entries []batchEntry
			var want []int64
			for k := range 60 {
				key := fmt.Sprintf("k%d", (k+round*30)%90)
				data := bytes.Repeat([]byte{byte(round), byte(k)}, 1+(k*37+round)%3000)
				switch {
				case k%13 == 5:
					key = "dup" // the last one wins
				case round == 2 && k%7 == 0 && model[key] != nil:
					key += "/under-a-file" // its parent is a file: fails at commit
				}
				r := int64(len(data))
				if model[store.Parent(key)] != nil {
					r = -int64(syscall.ENOTDIR)
				} else {
					model[key] = data
				}
				entries = append(entries, batchEntry{key: key, data: data})
				want = append(want, r)
			}
			res := runBatch(t, fx, true, entries)
			for k, r := range res {
				if r != want[k] {
					t.Fatalf("round %d: %s: %d, want %d", round, entries[k].key, r, want[k])
				}
			}
			for key, data := range model {
				if got := readKey(t, fx, key); !bytes.Equal(got, data) {
					t.Fatalf("round %d: %s holds %d B, want %d B", round, key, len(got), len(data))
				}
			}
		}
	})
}

// benchFixture is a fixture with directories a and a/b.
func benchFixture(b testing.TB) (*fuzzFixture, context.Context) {
	fx := newFuzzFixture(b)
	ctx := context.Background()
	for _, d := range []string{"a", "a/b"} {
		if _, err := fx.st.Mkdir(ctx, d, &store.Object{Mode: 0o755}); err != nil {
			b.Fatal(err)
		}
	}
	return fx, ctx
}

// BenchmarkBatchPut measures the daemon's work for one BATCH_PUT of 64
// new 4 KiB keys from the caller's memory, two directories deep, with no
// kernel in the way (b.N calls; ns and allocations are per call).
func BenchmarkBatchPut(b *testing.B) {
	fx, ctx := benchFixture(b)
	data := bytes.Repeat([]byte{7}, 4096)
	entries := make([]batchEntry, 64)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		for k := range entries {
			entries[k] = batchEntry{key: fmt.Sprintf("a/b/k%d-%d", i, k), data: data}
		}
		runBatch(b, fx, true, entries)
		if i%16 == 15 {
			// Keep the 8 MiB store from filling.
			b.StopTimer()
			for j := i - 15; j <= i; j++ {
				for k := range entries {
					_ = fx.st.Delete(ctx, fmt.Sprintf("a/b/k%d-%d", j, k), 0)
				}
			}
			b.StartTimer()
		}
	}
}

// BenchmarkBatchPutResident is BenchmarkBatchPut in a store holding 64k
// keys (256 MiB), as a serving engine's cache is: the index, LRU and body
// maps are larger than the CPU's caches. Eviction is on, as in the
// daemon by default, so every put moves its key up the index's LRU. "new" puts keys that are not
// there (b.N*64 of them, at most 8192 calls; "new-steady" removes each
// 16 calls' keys after them, untimed, so the store stays at 64k keys and
// its tables do not grow), "over" replaces resident ones, in an order
// that visits them all once in 1024 calls; "over-1k" is "over" in a store
// of 1024 keys, whose tables stay in the CPU's caches.
func BenchmarkBatchPutResident(b *testing.B) {
	const maxNew = 8192 * 64
	data := bytes.Repeat([]byte{7}, 4096)
	for _, mode := range []string{"new", "new-steady", "over", "over-1k"} {
		over, steady := strings.HasPrefix(mode, "over"), mode == "new-steady"
		keys := 64 << 10
		if mode == "over-1k" {
			keys = 1 << 10
		}
		name := func(i int) string { return fmt.Sprintf("a/k%d", i%keys) }
		b.Run(mode, func(b *testing.B) {
			fx := newFixtureWith(b, (keys+maxNew)*4096+(8<<20), true)
			if _, err := fx.st.Mkdir(context.Background(), "a", &store.Object{Mode: 0o755}); err != nil {
				b.Fatal(err)
			}
			entries := make([]batchEntry, 64)
			for i := 0; i < keys; i += 64 {
				for k := range entries {
					entries[k] = batchEntry{key: name(i + k), data: data}
				}
				runBatch(b, fx, true, entries)
			}
			b.ReportAllocs()
			defer reportKeyWork(b, fx.root.fs)()
			for i := 0; b.Loop(); i++ {
				if !over && i >= maxNew/64 {
					b.Fatal("run it with -benchtime of at most 8192x")
				}
				for k := range entries {
					if over {
						entries[k] = batchEntry{key: name((i*64 + k) * 40503), data: data}
					} else {
						entries[k] = batchEntry{key: fmt.Sprintf("a/n%d", i*64+k), data: data}
					}
				}
				runBatch(b, fx, true, entries)
				if steady && i%16 == 15 {
					b.StopTimer()
					for j := (i - 15) * 64; j < (i+1)*64; j++ {
						if err := fx.st.Delete(context.Background(), fmt.Sprintf("a/n%d", j), 0); err != nil {
							b.Fatal(err)
						}
					}
					b.StartTimer()
				}
			}
		})
	}
}

// BenchmarkBatchPutParallel is BenchmarkBatchPutResident's "over" with
// one call at a time ("calls=1") and with four calls in flight together
// ("calls=4"), as the clients send them on a host of eight CPUs or more
// (ioctl.BatchInFlight), each replacing keys of its own: the gap between
// the two work-ns/key figures is what the calls cost each other (waits
// for each other's locks, which mutexprofile attributes, and cache lines
// that move between CPUs). The store has room for every key twice over,
// so that eviction stays out of it.
func BenchmarkBatchPutParallel(b *testing.B) {
	data := bytes.Repeat([]byte{7}, 4096)
	const keys = 64 << 10
	for _, workers := range []int{1, 4} {
		b.Run(fmt.Sprintf("calls=%d", workers), func(b *testing.B) {
			fx := newFixtureWith(b, 2*keys*4096+(64<<20), true)
			if _, err := fx.st.Mkdir(context.Background(), "a", &store.Object{Mode: 0o755}); err != nil {
				b.Fatal(err)
			}
			name := func(i int) string { return fmt.Sprintf("a/k%d", i%keys) }
			entries := make([]batchEntry, 64)
			for i := 0; i < keys; i += 64 {
				for k := range entries {
					entries[k] = batchEntry{key: name(i + k), data: data}
				}
				runBatch(b, fx, true, entries)
			}
			var next atomic.Int64 // calls handed out
			var wg sync.WaitGroup
			b.ResetTimer()
			defer reportKeyWork(b, fx.root.fs)()
			for w := range workers {
				wg.Go(func() {
					entries := make([]batchEntry, 64)
					for i := int(next.Add(1)) - 1; i < b.N; i = int(next.Add(1)) - 1 {
						for k := range entries {
							// Worker w owns the keys equal to w mod workers.
							entries[k] = batchEntry{key: name(((i*64+k)*40503%(keys/workers))*workers + w), data: data}
						}
						runBatch(b, fx, true, entries)
					}
				})
			}
			wg.Wait()
		})
	}
}

// reportKeyWork reports the daemon's own work per key (handler time
// minus transfers, as the bench's key_work_us) of the calls between it
// and the call of the function it returns.
func reportKeyWork(b *testing.B, f *FS) func() {
	m := (&Mount{fs: f}).Batches
	before := m()
	return func() {
		after := m()
		if keys := after.Keys - before.Keys; keys > 0 {
			work := int64(after.HandlerNs-before.HandlerNs) - int64(after.TransferNs-before.TransferNs)
			b.ReportMetric(float64(work)/float64(keys), "work-ns/key")
		}
	}
}

// BenchmarkBatchPutSize is BenchmarkBatchPut's new keys at the sizes of
// KV blocks, 64 a call from the caller's memory, each 4 calls' keys
// removed after them: the work a key (work-ns/key, the bench's
// key_work_us) grows with the value, for the call's copy of up to 64 MiB
// through the CPU leaves the caches to the value and the commit after it
// finds the index, the bodies and the allocator cold, as a GPU call's
// commit after a long wait does.
func BenchmarkBatchPutSize(b *testing.B) {
	benchPutBlocks(b, putBlocks{sizes: []int{16 << 10, 256 << 10, 1 << 20}, calls: 4, room: 2})
}

// BenchmarkBatchPutGrow is BenchmarkBatchPutSize in a store that fills
// up: 48 calls of 64 new keys before any is removed, so the index and
// the heap grow as in a cache being filled (what a key leaves on the
// heap shows in B/op; the body table's leaves were 2 KiB of it a 1 MiB
// value).
func BenchmarkBatchPutGrow(b *testing.B) {
	benchPutBlocks(b, putBlocks{sizes: []int{16 << 10, 1 << 20}, calls: 48, room: 2})
}

// BenchmarkBatchPutCold is BenchmarkBatchPutSize's 16 KiB keys, 16 or
// 64 a call, each call after the CPU's caches are filled with other
// data (untimed): what a call costs when its data, and its code beyond
// the first-level cache, are cold, as the first calls of a burst find
// them. On the dev VM (Intel Xeon, 2026-12-08) the work a key went from
// 1.2-1.6 us to 2.1-3.7 at 64 keys a call and from 2.3 to 4.8-5.9 at 16:
// about 36 us a call and 0.8 us a key more when cold. Run it with
// -benchtime 100x: each eviction writes a buffer of twice the
// last-level cache three times over (about 0.1 s there), and the buffer
// stays on the heap for the benchmarks run after it.
func BenchmarkBatchPutCold(b *testing.B) {
	for _, per := range []int{16, 64} {
		b.Run(fmt.Sprint(per, "keys"), func(b *testing.B) {
			benchPutBlocks(b, putBlocks{sizes: []int{16 << 10}, calls: 4, room: 2, per: per, cold: true})
		})
	}
}

// putBlocks is what benchPutBlocks puts: new keys of each size, per a
// call (64 if 0), into a store of room times what calls calls put, each
// calls calls' keys removed after them; with cold, each call after
// evictCaches.
type putBlocks struct {
	sizes            []int
	calls, room, per int
	cold             bool
}

// benchPutBlocks runs o's calls from the caller's memory, the removals
// and evictions untimed.
func benchPutBlocks(b *testing.B, o putBlocks) {
	per := o.per
	if per == 0 {
		per = 64
	}
	for _, size := range o.sizes {
		b.Run(fmt.Sprint(size>>10, "KiB"), func(b *testing.B) {
			fx := newFixtureWith(b, o.room*o.calls*per*size+(64<<20), true)
			ctx := context.Background()
			if _, err := fx.st.Mkdir(ctx, "a", &store.Object{Mode: 0o755}); err != nil {
				b.Fatal(err)
			}
			data := bytes.Repeat([]byte{7}, size)
			entries := make([]batchEntry, per)
			b.ReportAllocs()
			defer reportKeyWork(b, fx.root.fs)()
			for i := 0; b.Loop(); i++ {
				for k := range entries {
					entries[k] = batchEntry{key: fmt.Sprintf("a/n%d", i*per+k), data: data}
				}
				if o.cold {
					b.StopTimer()
					evictCaches()
					b.StartTimer()
				}
				runBatch(b, fx, true, entries)
				if i%o.calls == o.calls-1 {
					b.StopTimer()
					for j := (i - o.calls + 1) * per; j < (i+1)*per; j++ {
						if err := fx.st.Delete(ctx, fmt.Sprintf("a/n%d", j), 0); err != nil {
							b.Fatal(err)
						}
					}
					b.StartTimer()
				}
			}
		})
	}
}

// evictBuf is evictCaches' memory: twice the last-level cache that
// sysfs reports (256 MiB where it reports none), 64 MiB to 1 GiB.
var evictBuf = sync.OnceValue(func() []byte {
	n := uint64(128 << 20)
	if raw, err := os.ReadFile("/sys/devices/system/cpu/cpu0/cache/index3/size"); err == nil {
		if k, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(string(raw)), "K"), 10, 64); err == nil {
			n = k << 10
		}
	}
	return make([]byte, min(max(2*n, 64<<20), 1<<30))
})

// evictCaches writes a byte of every line of evictBuf three times over,
// leaving the caches full of it: a single pass of a stream, which caches
// that resist scans keep from most of their ways, evicts little.
func evictCaches() {
	buf := evictBuf()
	for range 3 {
		for i := 0; i < len(buf); i += 64 {
			buf[i]++
		}
	}
}

// BenchmarkBatchGet measures one BATCH_GET of 64 4 KiB keys into the
// caller's memory, two directories deep (per call, as BenchmarkBatchPut).
func BenchmarkBatchGet(b *testing.B) {
	fx, _ := benchFixture(b)
	data := bytes.Repeat([]byte{7}, 4096)
	const keys = 1024
	for i := 0; i < keys; i += 64 {
		entries := make([]batchEntry, 64)
		for k := range entries {
			entries[k] = batchEntry{key: fmt.Sprintf("a/b/k%d", i+k), data: data}
		}
		runBatch(b, fx, true, entries)
	}
	entries := make([]batchEntry, 64)
	for k := range entries {
		entries[k].data = make([]byte, 4096)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		for k := range entries {
			entries[k].key = fmt.Sprintf("a/b/k%d", (i*64+k)%keys)
		}
		runBatch(b, fx, false, entries)
	}
}

// TestExclusiveInBatch: exclusive puts batch with the plain ones; a key
// that exists, or that an earlier entry of the batch creates, gets EEXIST
// and keeps its value.
func TestExclusiveInBatch(t *testing.T) {
	fx := newFuzzFixture(t)
	runBatch(t, fx, true, []batchEntry{{key: "e1", data: []byte("old")}})
	excl := ioctl.FlagExcl
	res := runBatch(t, fx, true, []batchEntry{
		{key: "e1", data: []byte("new"), flags: excl},
		{key: "e2", data: []byte("first"), flags: excl},
		{key: "e2", data: []byte("second"), flags: excl},
		{key: "e3", data: []byte("plain")},
	})
	want := []int64{-int64(syscall.EEXIST), 5, -int64(syscall.EEXIST), 5}
	for i := range want {
		if res[i] != want[i] {
			t.Fatalf("results %v, want %v", res, want)
		}
	}
	for key, v := range map[string]string{"e1": "old", "e2": "first", "e3": "plain"} {
		if got := readKey(t, fx, key); string(got) != v {
			t.Errorf("%s = %q, want %q", key, got, v)
		}
	}
}

// TestNoRoomKeepsOrder: an entry that finds no room goes again after the
// others, unless a later entry of the call wrote its key: the later value
// stays (the earlier one fails with ENOSPC).
func TestNoRoomKeepsOrder(t *testing.T) {
	fx := newFuzzFixture(t) // 8 MiB, eviction off
	big := bytes.Repeat([]byte{1}, 3<<20)
	runBatch(t, fx, true, []batchEntry{{key: "k", data: big}, {key: "a", data: big}})
	res := runBatch(t, fx, true, []batchEntry{
		{key: "k", data: bytes.Repeat([]byte{2}, 3<<20)}, // no room until k's old version goes
		{key: "k", data: []byte("later")},
	})
	if res[0] != -int64(syscall.ENOSPC) || res[1] != 5 {
		t.Fatalf("results %v, want [-ENOSPC 5]", res)
	}
	if got := readKey(t, fx, "k"); string(got) != "later" {
		t.Fatalf("k holds %d B, want the later entry's value", len(got))
	}
	// Alone, the same put goes again and fits once the others committed.
	res = runBatch(t, fx, true, []batchEntry{
		{key: "k", data: bytes.Repeat([]byte{3}, 6<<20)}, // a's 3 MiB held: no room in the batch
		{key: "a", data: []byte("small")},                // frees them when it commits
	})
	if res[0] != 6<<20 || res[1] != 5 {
		t.Fatalf("results %v, want [%d 5]", res, 6<<20)
	}
}

// TestParentsInBatch: FlagParents makes a key's missing directories (mode
// 0755, the caller's), and only where the caller may write; without it a
// missing directory is ENOENT, a file in the way ENOTDIR either way.
func TestParentsInBatch(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	par := ioctl.FlagParents
	res := runBatch(t, fx, true, []batchEntry{
		{key: "x/y/z", data: []byte("no")},
		{key: "x/y/z", data: []byte("deep"), flags: par},
		{key: "x/y/w", data: []byte("next"), flags: par | ioctl.FlagExcl},
		{key: "f", data: []byte("file")},
		{key: "f/g", data: []byte("under a file"), flags: par},
		{key: "x/y/z/q", data: []byte("under a key"), flags: par},
	})
	want := []int64{-int64(syscall.ENOENT), 4, 4, 4, -int64(syscall.ENOTDIR), -int64(syscall.ENOTDIR)}
	for i := range want {
		if res[i] != want[i] {
			t.Fatalf("results %v, want %v", res, want)
		}
	}
	for _, d := range []string{"x", "x/y"} {
		o, err := fx.st.Stat(ctx, d)
		if err != nil || o.Kind != store.KindDir || o.Mode&0o7777 != 0o755 || o.Uid != 0 {
			t.Fatalf("%s: %+v %v", d, o, err)
		}
	}
	if got := readKey(t, fx, "x/y/z"); string(got) != "deep" {
		t.Fatalf("x/y/z = %q", got)
	}
	// A user who may not write the directory makes nothing in it.
	res = runBatchAs(t, fx, 1000, true, []batchEntry{{key: "x/other/k", data: []byte("v"), flags: par}})
	if res[0] != -int64(syscall.EACCES) {
		t.Fatalf("unprivileged put with parents: %v", res)
	}
	if _, err := fx.st.Stat(ctx, "x/other"); err == nil {
		t.Fatal("a directory was made where its maker may not write")
	}
	// Gets take no put flags.
	if res := runBatch(t, fx, false, []batchEntry{{key: "x/y/z", data: make([]byte, 8), flags: par}}); res[0] >= 0 {
		t.Fatalf("get with FlagParents: %v", res)
	}
	// The keys of a call act in order also across the chunks of a long
	// call: a key put earlier, in a chunk whose copies are still under
	// way, is a file where a later key's directory would go.
	for _, chunked := range []bool{false, true} {
		chunkAlways = chunked
		var entries []batchEntry
		for i := range chunkKeys {
			entries = append(entries, batchEntry{key: fmt.Sprintf("c%v/k%d", chunked, i), data: []byte("v"), flags: par})
		}
		entries = append(entries, batchEntry{key: fmt.Sprintf("c%v/k3/sub", chunked), data: []byte("w"), flags: par})
		res := runBatch(t, fx, true, entries)
		chunkAlways = false
		for i, r := range res[:len(res)-1] {
			if r != 1 {
				t.Fatalf("chunked %v: key %d: %d", chunked, i, r)
			}
		}
		if last := res[len(res)-1]; last != -int64(syscall.ENOTDIR) {
			t.Fatalf("chunked %v: a key below one the call put first: %d, want ENOTDIR", chunked, last)
		}
	}
}

// BenchmarkBatchPutOne is BenchmarkBatchPut with one key a call: what a
// call costs beyond its keys (the caller, the directory's checks, the
// placement, the commit's fixed work).
func BenchmarkBatchPutOne(b *testing.B) {
	fx, ctx := benchFixture(b)
	data := bytes.Repeat([]byte{7}, 4096)
	entries := make([]batchEntry, 1)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		entries[0] = batchEntry{key: fmt.Sprintf("a/b/k%d", i%1024), data: data}
		runBatch(b, fx, true, entries)
		if i%1024 == 1023 {
			b.StopTimer()
			for j := range 1024 {
				_ = fx.st.Delete(ctx, fmt.Sprintf("a/b/k%d", j), 0)
			}
			b.StartTimer()
		}
	}
}

// TestBatchMovesLRU: the keys a batch puts, and those a batch gets, become
// the most recently used, in the call's order; a key a get does not find,
// or may not read, moves nothing.
func TestBatchMovesLRU(t *testing.T) {
	fx := newFuzzFixture(t)
	val := []byte("value")
	want := func(order ...string) {
		t.Helper()
		if got := fx.idx.LRUTail(100); !slices.Equal(got, order) {
			t.Fatalf("LRU, least recent first: %q, want %q", got, order)
		}
	}
	var puts []batchEntry
	for _, k := range []string{"k0", "k1", "k2", "k3"} {
		puts = append(puts, batchEntry{key: k, data: val})
	}
	runBatch(t, fx, true, puts)
	// The fixture's file "f" was made first.
	want("f", "k0", "k1", "k2", "k3")
	buf := func() []byte { return make([]byte, len(val)) }
	res := runBatch(t, fx, false, []batchEntry{{key: "k2", data: buf()}, {key: "gone", data: buf()}, {key: "k0", data: buf()}})
	if res[0] != int64(len(val)) || res[1] != -int64(syscall.ENOENT) || res[2] != int64(len(val)) {
		t.Fatalf("gets: %v", res)
	}
	want("f", "k1", "k3", "k2", "k0")
	runBatch(t, fx, true, []batchEntry{{key: "k1", data: val}})
	want("f", "k3", "k2", "k0", "k1")
	// A get the caller may not make moves nothing: another user cannot
	// keep a key cached by asking for it.
	if _, err := fx.st.Update(context.Background(), "k2", 0, func(o *store.Object) error { o.Mode = 0o600; return nil }); err != nil {
		t.Fatal(err)
	}
	want("f", "k3", "k2", "k0", "k1") // (a chmod is no use)
	res = runBatchAs(t, fx, 65534, false, []batchEntry{{key: "k3", data: buf()}, {key: "k2", data: buf()}})
	if res[0] != int64(len(val)) || res[1] != -int64(syscall.EACCES) {
		t.Fatalf("gets by another user: %v", res)
	}
	want("f", "k2", "k0", "k1", "k3")
}

// TestPutParentsAgainstRmdir: a put with FlagParents lands although
// another client keeps removing the directories it makes (while they are
// still empty), also between its path check and its commit.
func TestPutParentsAgainstRmdir(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	val := []byte("parents")
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			_ = fx.st.Rmdir(ctx, "p/q")
			_ = fx.st.Rmdir(ctx, "p")
			// As often as another client could: one that removes them
			// faster than a put makes them keeps any put out, as it would
			// keep out mkdir -p and a create.
			time.Sleep(20 * time.Microsecond)
		}
	}()
	defer func() { close(stop); <-done }()
	for i := range 3000 {
		res := runBatch(t, fx, true, []batchEntry{{key: "p/q/k", data: val, flags: ioctl.FlagParents}})
		if res[0] != int64(len(val)) {
			t.Fatalf("put %d of p/q/k with FlagParents while p and q are removed: %d", i, res[0])
		}
		if err := fx.st.Delete(ctx, "p/q/k", 0); err != nil {
			t.Fatal(err)
		}
	}
}

// TestExclusiveOverMadeDirectory: an exclusive put of a key that an
// earlier entry of the same call made a directory (FlagParents) gets
// EEXIST, as a put one key at a time does, whether or not the two were
// looked up together.
func TestExclusiveOverMadeDirectory(t *testing.T) {
	fx := newFuzzFixture(t)
	par, excl := ioctl.FlagParents, ioctl.FlagExcl
	res := runBatch(t, fx, true, []batchEntry{
		{key: "x/y/z", data: []byte("v"), flags: par},
		{key: "x/y", data: []byte("w"), flags: excl},
		{key: "x", data: []byte("w"), flags: excl},
	})
	if want := []int64{1, -int64(syscall.EEXIST), -int64(syscall.EEXIST)}; !slices.Equal(res, want) {
		t.Fatalf("results %v, want %v", res, want)
	}
}

// TestBatchPathThroughEarlierKey: a key whose path runs through a file
// an earlier entry of the same call put gets ENOTDIR, as it does put
// after that entry on its own, and one whose directory is missing
// ENOENT; the keys around them are put.
func TestBatchPathThroughEarlierKey(t *testing.T) {
	fx := newFuzzFixture(t)
	res := runBatch(t, fx, true, []batchEntry{
		{key: "q/a", data: []byte("v")}, // q missing yet
		{key: "q", data: []byte("file")},
		{key: "q/g", data: []byte("v")},
		{key: "q/h/i", data: []byte("v")},
		{key: "k", data: []byte("v")},
	})
	want := []int64{-int64(syscall.ENOENT), 4, -int64(syscall.ENOTDIR), -int64(syscall.ENOTDIR), 1}
	if !slices.Equal(res, want) {
		t.Fatalf("results %v, want %v", res, want)
	}
}

// TestOpSetBlocks: a call's segments and buffer lists come from its
// opSet's blocks, which go back to the pool cleared: a later call finds
// no segment, buffer or memory of the one before. A buffer block is
// handed out with room for the call only, so that an append past it
// leaves the block (release clears what it handed out).
func TestOpSetBlocks(t *testing.T) {
	mem := make([]byte, 8)
	set := new(opSet) // not the pool's: no other call has it
	segs := set.segBlock(3)
	for i := range segs {
		segs[i] = seg{kind: segMem, mem: mem, off: uint64(i), n: 1}
	}
	bufs := set.bufBlock(3)
	if len(bufs) != 0 || cap(bufs) != 3 {
		t.Fatalf("bufBlock(3): len %d cap %d, want 0 and 3", len(bufs), cap(bufs))
	}
	for range 3 {
		bufs = append(bufs, transfer.HostBuffer(mem))
	}
	set.release()
	for i, s := range segs {
		if s.mem != nil || s.kind != 0 || s.n != 0 {
			t.Fatalf("segment %d kept after release: %+v", i, s)
		}
	}
	for i, b := range bufs {
		if b.Mem != nil || b.Kind != 0 {
			t.Fatalf("buffer %d kept after release: %+v", i, b)
		}
	}

	// A block larger than the call's room: the append past the room
	// must not land in it.
	set = &opSet{bufs: make([]transfer.Buffer, 0, 3)}
	block := set.bufs[:3]
	bufs = set.bufBlock(2)
	for range 3 {
		bufs = append(bufs, transfer.HostBuffer(mem))
	}
	set.release()
	for i, b := range block {
		if b.Mem != nil {
			t.Fatalf("buffer %d of the block kept after release: an append went past the call's room", i)
		}
	}
}

// TestBatchPutOverImplicitDirectory: a batch put of a name that is an
// implicit directory (keys under it, no object of its own, as a shared
// index can hold) fails that key alone with EISDIR and leaves it a
// directory; the call's other new keys commit, and so does a key under
// the implicit directory.
func TestBatchPutOverImplicitDirectory(t *testing.T) {
	fx := newFuzzFixture(t)
	ctx := context.Background()
	if _, err := fx.st.Mkdir(ctx, "imp", &store.Object{Mode: 0o755}); err != nil {
		t.Fatal(err)
	}
	res := runBatch(t, fx, true, []batchEntry{{key: "imp/x", data: []byte("x")}})
	if res[0] != 1 {
		t.Fatalf("put imp/x: %d", res[0])
	}
	o, err := fx.idx.Get(ctx, "imp")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fx.idx.CompareAndSwap(ctx, store.Swap{Key: "imp", Old: o.Version}); err != nil {
		t.Fatal(err)
	}
	res = runBatch(t, fx, true, []batchEntry{
		{key: "n1", data: []byte("one")},
		{key: "imp", data: []byte("file")},
		{key: "imp/y", data: []byte("yy")},
		{key: "n2", data: []byte("two!")},
	})
	if want := []int64{3, -int64(syscall.EISDIR), 2, 4}; !slices.Equal(res, want) {
		t.Fatalf("results %v, want %v", res, want)
	}
	if st, err := fx.st.Stat(ctx, "imp"); err != nil || st.Kind != store.KindDir || st.Version != 0 {
		t.Fatalf("imp after the put: %+v, %v; want an implicit directory", st, err)
	}
}
