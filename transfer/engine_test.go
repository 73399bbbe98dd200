package transfer

import (
	"bytes"
	"context"
	"errors"
	"golang.org/x/sys/unix"
	"math/rand"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"unsafe"

	"github.com/mooncake-fs/mooncake-fs/segment"
)

func newEngine(t *testing.T, segSize int, o Options) (*Engine, *segment.Table) {
	t.Helper()
	tab := segment.NewTable()
	for id := range 2 {
		if err := tab.Add(segment.NewSegment(segment.ID(id), make([]byte, segSize))); err != nil {
			t.Fatal(err)
		}
	}
	o.Local = tab
	e, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.Close)
	return e, tab
}

func TestRoundTrip(t *testing.T) {
	for _, c := range []struct {
		name string
		size int
		opts Options
	}{
		{"inline", 64 << 10, Options{}},
		{"split", 24 << 20, Options{Workers: 3, SplitBytes: 1 << 20, ChunkBytes: 64 << 10}},
	} {
		t.Run(c.name, func(t *testing.T) {
			e, _ := newEngine(t, 32<<20, c.opts)
			src := make([]byte, c.size)
			rand.New(rand.NewSource(1)).Read(src)
			// Spread over two segments, the second extent unaligned.
			half := uint64(c.size / 2)
			ext := []segment.Extent{{Segment: 1, Off: 4096, Len: half}, {Segment: 0, Off: 12345, Len: uint64(c.size) - half}}
			var reqs []Request
			var off uint64
			for _, x := range ext {
				reqs = append(reqs, Request{Op: Write, Buf: HostBuffer(src), BufOff: off, Extent: x})
				off += x.Len
			}
			if err := e.Submit(context.Background(), reqs); err != nil {
				t.Fatal(err)
			}
			dst := make([]byte, c.size)
			for i := range reqs {
				reqs[i].Op = Read
				reqs[i].Buf = HostBuffer(dst)
			}
			if err := e.Submit(context.Background(), reqs); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(src, dst) {
				t.Fatal("round trip differs")
			}
			st := e.Stats()
			if st.BytesWritten != uint64(c.size) || st.BytesRead != uint64(c.size) || st.CopiedBytes != 2*uint64(c.size) {
				t.Fatalf("stats %+v: want one copy per byte each way", st)
			}
		})
	}
}

func TestBadRequests(t *testing.T) {
	e, tab := newEngine(t, 1<<20, Options{})
	buf := make([]byte, 8192)
	seg, _ := tab.Get(0)
	copy(seg.Mem, bytes.Repeat([]byte{7}, 1<<20))
	reqs := []Request{
		{Op: Read, Buf: HostBuffer(buf), BufOff: 0, Extent: segment.Extent{Segment: 0, Off: 0, Len: 4096}},        // fine
		{Op: Read, Buf: HostBuffer(buf), BufOff: 8000, Extent: segment.Extent{Segment: 0, Off: 0, Len: 4096}},     // past buffer
		{Op: Read, Buf: HostBuffer(buf), BufOff: 0, Extent: segment.Extent{Segment: 9, Off: 0, Len: 16}},          // no segment
		{Op: Write, Buf: HostBuffer(buf), BufOff: 0, Extent: segment.Extent{Segment: 0, Off: 1 << 20, Len: 4096}}, // past segment
		{Op: Read, Buf: HostBuffer(buf), BufOff: ^uint64(0), Extent: segment.Extent{Segment: 0, Off: 0, Len: 2}},  // overflow
	}
	err := e.Submit(context.Background(), reqs)
	if !errors.Is(err, ErrBadRequest) || !errors.Is(err, ErrNoStrategy) {
		t.Fatalf("err = %v", err)
	}
	if buf[0] != 7 || buf[4096] != 0 {
		t.Fatal("the valid request must still run, the bad ones must not touch the buffer")
	}
	if seg.Mem[(1<<20)-1] != 7 {
		t.Fatal("segment changed by a rejected write")
	}
}

func TestClosed(t *testing.T) {
	e, _ := newEngine(t, 1<<20, Options{})
	e.Close()
	if err := e.Submit(context.Background(), nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("err = %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	e2, _ := newEngine(t, 1<<20, Options{})
	if err := e2.Submit(ctx, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
}

func TestValidate(t *testing.T) {
	err := Options{Workers: -1, ChunkBytes: 10}.Validate()
	for _, want := range []string{"Local", "Workers", "ChunkBytes"} {
		if err == nil || !bytes.Contains([]byte(err.Error()), []byte(want)) {
			t.Errorf("Validate error %v does not name %s", err, want)
		}
	}
}

func BenchmarkSubmit(b *testing.B) {
	for _, size := range []int{1 << 20, 64 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			tab := segment.NewTable()
			_ = tab.Add(segment.NewSegment(0, make([]byte, size)))
			e, _ := New(Options{Local: tab})
			defer e.Close()
			buf := make([]byte, size)
			reqs := []Request{{Op: Write, Buf: HostBuffer(buf), Extent: segment.Extent{Segment: 0, Len: uint64(size)}}}
			b.SetBytes(int64(size))
			b.ResetTimer()
			for b.Loop() {
				_ = e.Submit(context.Background(), reqs)
			}
			b.ReportMetric(float64(size)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GB/s")
		})
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return "size=" + itoa(n>>20) + "MiB"
	}
	return "size=" + itoa(n>>10) + "KiB"
}

func itoa(n int) string {
	if n < 10 {
		return string(rune('0' + n))
	}
	return itoa(n/10) + string(rune('0'+n%10))
}

// TestProcessVM copies between a segment and this process's own memory by
// address, the way PUT_VM and GET_VM reach a client.
func TestProcessVM(t *testing.T) {
	for _, split := range []bool{false, true} {
		o := Options{}
		if split {
			o = Options{Workers: 2, SplitBytes: 1 << 20, ChunkBytes: 64 << 10}
		}
		e, _ := newEngine(t, 8<<20, o)
		src := make([]byte, 3<<20)
		rand.New(rand.NewSource(3)).Read(src)
		pid := os.Getpid()
		addr := uint64(uintptr(unsafe.Pointer(&src[0])))
		ext := []segment.Extent{{Segment: 0, Off: 8192, Len: 1 << 20}, {Segment: 1, Off: 0, Len: 2 << 20}}
		var reqs []Request
		var off uint64
		for _, x := range ext {
			reqs = append(reqs, Request{Op: Write, Buf: VMBuffer(pid, addr, uint64(len(src))), BufOff: off, Extent: x})
			off += x.Len
		}
		if err := e.Submit(context.Background(), reqs); err != nil {
			t.Fatal(err)
		}
		dst := make([]byte, len(src))
		daddr := uint64(uintptr(unsafe.Pointer(&dst[0])))
		for i := range reqs {
			reqs[i].Op = Read
			reqs[i].Buf = VMBuffer(pid, daddr, uint64(len(dst)))
		}
		if err := e.Submit(context.Background(), reqs); err != nil {
			t.Fatal(err)
		}
		runtime.KeepAlive(src)
		if !bytes.Equal(src, dst) {
			t.Fatalf("split=%v: round trip differs", split)
		}
		if st := e.Stats(); st.CopiedBytes != 2*uint64(len(src)) {
			t.Fatalf("copied %d B, want one copy per byte each way", st.CopiedBytes)
		}
		// An address outside the process fails with ErrFault and no copy.
		bad := []Request{{Op: Write, Buf: VMBuffer(pid, 8, 4096), Extent: segment.Extent{Segment: 0, Len: 4096}}}
		if err := e.Submit(context.Background(), bad); !errors.Is(err, ErrFault) {
			t.Fatalf("bad address: %v", err)
		}
	}
}

// TestProcessVMWithoutWorkers: a split copy of process memory runs while
// every shared worker is busy and their queue is full. Its pages may be
// a mapping whose faults wait on copies that need those workers (a file
// of the mount itself), so it must not queue behind them: before, this
// call waited for the workers for good. Nor does it wait for helpers.
func TestProcessVMWithoutWorkers(t *testing.T) {
	e, _ := newEngine(t, 8<<20, Options{Workers: 2, SplitBytes: 1 << 20, ChunkBytes: 64 << 10})
	release := make(chan struct{})
	var busy sync.WaitGroup
	for range e.opts.Workers + cap(e.work) {
		busy.Add(1)
		e.work <- func() { defer busy.Done(); <-release }
	}
	src := make([]byte, 4<<20)
	rand.New(rand.NewSource(4)).Read(src)
	addr := uint64(uintptr(unsafe.Pointer(&src[0])))
	reqs := []Request{{Op: Write, Buf: VMBuffer(os.Getpid(), addr, uint64(len(src))), Extent: segment.Extent{Segment: 0, Len: uint64(len(src))}}}
	if err := e.Submit(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	close(release)
	busy.Wait()
	// With every helper taken (by calls stalled on their pages), a call
	// copies alone and takes none.
	limit := int64(vmHelpersPerWorker * e.opts.Workers)
	e.vmHelpers.Store(limit)
	dst := make([]byte, len(src))
	reqs[0].Op, reqs[0].Buf = Read, VMBuffer(os.Getpid(), uint64(uintptr(unsafe.Pointer(&dst[0]))), uint64(len(dst)))
	if err := e.Submit(context.Background(), reqs); err != nil {
		t.Fatal(err)
	}
	runtime.KeepAlive(src)
	if !bytes.Equal(src, dst) {
		t.Fatal("the copies without workers or helpers differ")
	}
	if n := e.vmHelpers.Load(); n != limit {
		t.Fatalf("%d helpers taken after the call, want the %d it found", n, limit)
	}
	// Many calls at once never hold more than the limit, and give back
	// every helper.
	e.vmHelpers.Store(0)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			b := make([]byte, 4<<20)
			r := []Request{{Op: Write, Buf: VMBuffer(os.Getpid(), uint64(uintptr(unsafe.Pointer(&b[0]))), uint64(len(b))), Extent: segment.Extent{Segment: 1, Len: uint64(len(b))}}}
			if err := e.Submit(context.Background(), r); err != nil {
				t.Error(err)
			}
			if n := e.vmHelpers.Load(); n > limit {
				t.Errorf("%d helpers taken, at most %d", n, limit)
			}
			runtime.KeepAlive(b)
		})
	}
	wg.Wait()
	if n := e.vmHelpers.Load(); n != 0 {
		t.Fatalf("%d helpers still taken", n)
	}
}

// TestRegisteredFault: a client truncating its registered file under a
// copy makes the mapping fault; the request fails, the daemon lives.
func TestRegisteredFault(t *testing.T) {
	for _, split := range []bool{false, true} {
		o := Options{}
		if split {
			o = Options{Workers: 2, SplitBytes: 1 << 20, ChunkBytes: 64 << 10}
		}
		e, _ := newEngine(t, 4<<20, o)
		fd, err := unix.MemfdCreate("fault", 0)
		if err != nil {
			t.Skip(err)
		}
		defer unix.Close(fd)
		if err := unix.Ftruncate(fd, 2<<20); err != nil {
			t.Fatal(err)
		}
		mem, err := unix.Mmap(fd, 0, 2<<20, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(mem)
		if err := unix.Ftruncate(fd, 0); err != nil {
			t.Fatal(err)
		}
		for _, op := range []Op{Write, Read} {
			reqs := []Request{{Op: op, Buf: Buffer{Kind: Registered, Mem: mem}, Extent: segment.Extent{Segment: 0, Len: 2 << 20}}}
			if err := e.Submit(context.Background(), reqs); !errors.Is(err, ErrFault) {
				t.Fatalf("split=%v %v: err = %v, want ErrFault", split, op, err)
			}
		}
	}
}

// A flight holds the engine open until it is waited for, reports each
// request's outcome like SubmitEach, and its caller may submit other
// batches meanwhile.
func TestFlight(t *testing.T) {
	e, _ := newEngine(t, 1<<20, Options{})
	src := []byte("flight bytes")
	reqs := []Request{
		{Op: Write, Buf: HostBuffer(src), Extent: segment.Extent{Segment: 0, Off: 0, Len: uint64(len(src))}},
		{Op: Write, Buf: HostBuffer(src), Extent: segment.Extent{Segment: 7, Off: 0, Len: 4}},
	}
	f := e.Start(context.Background(), reqs)
	// Nested while the first is in flight: no deadlock with a Close that
	// waits (below, this one runs before Close is called).
	dst := make([]byte, len(src))
	if err := e.Submit(context.Background(), []Request{{Op: Read, Buf: HostBuffer(dst), Extent: reqs[0].Extent}}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatalf("read %q", dst)
	}
	closed := make(chan struct{})
	var waited atomic.Bool
	go func() {
		e.Close()
		if !waited.Load() {
			t.Error("Close returned before the flight was waited for")
		}
		close(closed)
	}()
	for !e.isClosed() {
		runtime.Gosched()
	}
	if got := e.Start(context.Background(), reqs[:1]).Wait(); len(got) != 1 || !errors.Is(got[0], ErrClosed) {
		t.Fatalf("Start after Close: %v", got)
	}
	waited.Store(true)
	each := f.Wait()
	<-closed
	if len(each) != 2 || each[0] != nil || each[1] == nil {
		t.Fatalf("per-request errors %v: want the second alone", each)
	}
	if again := f.Wait(); len(again) != 2 || again[1] != each[1] {
		t.Fatalf("second Wait %v, first %v", again, each)
	}
}

// isClosed reports whether Close was called.
func (e *Engine) isClosed() bool {
	e.closeMu.RLock()
	defer e.closeMu.RUnlock()
	return e.closed
}

// TestGPUPiecesFollow: only pieces adjacent on the device and in one
// segment, same direction, merge into one copy.
func TestGPUPiecesFollow(t *testing.T) {
	p := gpuPiece{op: Write, dev: 1 << 20, host: make([]byte, 4096), ext: segment.Extent{Segment: 1, Off: 8192, Len: 4096}, local: true, alloc: 1 << 20}
	next := p
	next.dev, next.ext.Off = p.dev+4096, p.ext.Off+4096
	if !next.follows(p) {
		t.Fatal("adjacent pieces do not follow")
	}
	for name, q := range map[string]func(q *gpuPiece){
		"gap on the device":  func(q *gpuPiece) { q.dev += 1 },
		"gap in the segment": func(q *gpuPiece) { q.ext.Off += 4096 },
		"other segment":      func(q *gpuPiece) { q.ext.Segment = 2 },
		"other direction":    func(q *gpuPiece) { q.op = Read },
		"bounce buffer":      func(q *gpuPiece) { q.local = false },
		"other allocation":   func(q *gpuPiece) { q.alloc = 2 << 20 },
	} {
		bad := next
		q(&bad)
		if bad.follows(p) {
			t.Errorf("%s: follows", name)
		}
	}
}

// TestVMJobs: large pieces are cut in chunks, runs of small ones kept
// together up to a chunk (or maxIov pieces), every byte in exactly one job
// and in order.
func TestVMJobs(t *testing.T) {
	const cb = 64 << 10
	mem := make([]byte, 8<<20)
	var pieces []vmPiece
	off := 0
	for i, n := range []int{4096, 4096, 200 << 10, 1, 60 << 10, 8 << 10, 128 << 10} {
		pieces = append(pieces, vmPiece{idx: i, op: Write, pid: 1, addr: uint64(off), local: mem[off : off+n]})
		off += n
	}
	for range 3000 { // more than maxIov small pieces
		pieces = append(pieces, vmPiece{idx: len(pieces), op: Write, pid: 1, addr: uint64(off), local: mem[off : off+16]})
		off += 16
	}
	jobs := vmJobs(pieces, cb)
	next := uint64(0)
	for _, j := range jobs {
		var n int
		for _, p := range j {
			if p.addr != next {
				t.Fatalf("piece at %d, want %d", p.addr, next)
			}
			next += uint64(len(p.local))
			n += len(p.local)
		}
		if n > cb || len(j) > maxIov || len(j) == 0 {
			t.Fatalf("a job of %d pieces, %d B", len(j), n)
		}
	}
	if next != uint64(off) {
		t.Fatalf("jobs cover %d B, want %d", next, off)
	}
	if len(jobs) > 12 {
		t.Fatalf("%d jobs: small pieces were not kept together", len(jobs))
	}
}

// TestProcessVMNeighbours: requests whose ranges continue each other, on
// either side, go as one range (vmCall merges them), and when a merged
// range runs into an unmapped page each request still gets its own
// outcome: the ones before the hole are done, the one in it fails.
func TestProcessVMNeighbours(t *testing.T) {
	e, tab := newEngine(t, 1<<20, Options{Workers: 1})
	page := os.Getpagesize()
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(4*page), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANONYMOUS|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	mem := unsafe.Slice((*byte)(p), 4*page)
	rand.New(rand.NewSource(5)).Read(mem)
	base, pid := uint64(uintptr(p)), os.Getpid()
	// Four requests of one page each, neighbours in the process and in
	// segment 0 (the last two swapped there: two local runs).
	reqs := make([]Request, 4)
	for i := range reqs {
		off := uint64(i * page)
		if i >= 2 {
			off = uint64((5 - i) * page)
		}
		reqs[i] = Request{Op: Write, Buf: VMBuffer(pid, base, uint64(4*page)), BufOff: uint64(i * page),
			Extent: segment.Extent{Segment: 0, Off: off, Len: uint64(page)}}
	}
	if errs := e.SubmitEach(context.Background(), reqs); errors.Join(errs...) != nil {
		t.Fatal(errs)
	}
	seg, _ := tab.Get(0)
	at := func(off uint64) []byte { return seg.Bytes(segment.Extent{Segment: 0, Off: off, Len: uint64(page)}) }
	for i, r := range reqs {
		if got := at(r.Extent.Off); !bytes.Equal(got, mem[i*page:(i+1)*page]) {
			t.Fatalf("request %d: bytes differ", i)
		}
	}
	// The third page unmapped: reads back into all four.
	if err := unix.MunmapPtr(unsafe.Add(p, 2*page), uintptr(page)); err != nil {
		t.Fatal(err)
	}
	defer unix.MunmapPtr(p, uintptr(2*page))
	defer unix.MunmapPtr(unsafe.Add(p, 3*page), uintptr(page))
	clear(mem[:2*page])
	for i := range reqs {
		reqs[i].Op = Read
	}
	errs := e.SubmitEach(context.Background(), reqs)
	for i, err := range errs {
		if i == 2 && !errors.Is(err, ErrFault) || i != 2 && err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	for i := range 2 {
		if got := at(reqs[i].Extent.Off); !bytes.Equal(got, mem[i*page:(i+1)*page]) {
			t.Fatalf("request %d: not read back", i)
		}
	}
	if !bytes.Equal(at(uint64(2*page)), unsafe.Slice((*byte)(unsafe.Add(p, 3*page)), page)) {
		t.Fatal("request 3, after the hole: not read back")
	}
}

// TestReadWriteProcess: a caller's arguments in its memory come in and go
// back; memory it does not have fails with ErrFault.
func TestReadWriteProcess(t *testing.T) {
	e, _ := newEngine(t, 1<<20, Options{})
	src, dst := []byte("table of entries"), make([]byte, 16)
	pid := os.Getpid()
	if err := e.ReadProcess(pid, uint64(uintptr(unsafe.Pointer(&src[0]))), dst); err != nil || string(dst) != string(src) {
		t.Fatalf("read: %q, %v", dst, err)
	}
	if err := e.WriteProcess(pid, uint64(uintptr(unsafe.Pointer(&src[0]))), []byte("TABLE")); err != nil || string(src) != "TABLE of entries" {
		t.Fatalf("write: %q, %v", src, err)
	}
	if err := e.ReadProcess(pid, 8, dst); !errors.Is(err, ErrFault) {
		t.Fatalf("read of address 8: %v", err)
	}
	if err := e.WriteProcess(pid, 8, dst); !errors.Is(err, ErrFault) {
		t.Fatalf("write to address 8: %v", err)
	}
	// Two ranges at once, each with its own outcome.
	keys, dk := []byte("k1k2k3"), make([]byte, 6)
	srcAt, keysAt := uint64(uintptr(unsafe.Pointer(&src[0]))), uint64(uintptr(unsafe.Pointer(&keys[0])))
	clear(dst)
	if e0, e1 := e.ReadProcessPair(pid, srcAt, dst, keysAt, dk); e0 != nil || e1 != nil || string(dst) != string(src) || string(dk) != "k1k2k3" {
		t.Fatalf("pair: %q %q, %v %v", dst, dk, e0, e1)
	}
	clear(dk)
	if e0, e1 := e.ReadProcessPair(pid, 8, dst, keysAt, dk); !errors.Is(e0, ErrFault) || e1 != nil || string(dk) != "k1k2k3" {
		t.Fatalf("pair, the first unreadable: %v, %v, %q", e0, e1, dk)
	}
	if e0, e1 := e.ReadProcessPair(pid, srcAt, dst, 8, dk); e0 != nil || !errors.Is(e1, ErrFault) {
		t.Fatalf("pair, the second unreadable: %v, %v", e0, e1)
	}
	if st := e.Stats(); st.CopiedBytes != 0 {
		t.Fatalf("arguments counted as data: %d B", st.CopiedBytes)
	}
	runtime.KeepAlive(src)
	runtime.KeepAlive(keys)
}
