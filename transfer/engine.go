package transfer

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/segment"
	"github.com/prometheus/client_golang/prometheus"
)

// Resolver maps an extent of a local segment to its memory.
// *segment.Table implements it.
type Resolver interface {
	Bytes(e segment.Extent) ([]byte, error)
}

// Options configures an Engine.
type Options struct {
	// Local resolves extents of this daemon's segments. Required.
	Local Resolver
	// Workers copy chunks of large batches; 0 means runtime.NumCPU().
	Workers int
	// SplitBytes is the batch size from which copies are split across
	// workers; 0 means 8 MiB.
	SplitBytes uint64
	// ChunkBytes is the size of one worker's piece; 0 means 2 MiB.
	ChunkBytes uint64
	// Registerer receives the engine's metrics; nil registers nothing.
	Registerer prometheus.Registerer
	// Self is this node's name: requests whose Node is "" or Self are
	// local.
	Self string
	// Remote reaches other nodes' segments; nil: requests for other
	// nodes fail with ErrNoStrategy.
	Remote Transport
	// RDMA, when set, moves the bytes of remote requests to the peers
	// that have it too (rdma.go); Remote still carries the others and
	// every control call.
	RDMA *RDMA
}

// DefaultOptions returns the options New uses for zero fields.
func DefaultOptions() Options {
	return Options{Workers: runtime.NumCPU(), SplitBytes: 8 << 20, ChunkBytes: 2 << 20}
}

// Validate reports every bad field at once.
func (o Options) Validate() error {
	var errs []error
	if o.Local == nil {
		errs = append(errs, errors.New("transfer: Options.Local is required"))
	}
	if o.Workers < 0 {
		errs = append(errs, fmt.Errorf("transfer: Options.Workers %d < 0", o.Workers))
	}
	if o.ChunkBytes != 0 && o.ChunkBytes < 4096 {
		errs = append(errs, fmt.Errorf("transfer: Options.ChunkBytes %d < 4096", o.ChunkBytes))
	}
	return errors.Join(errs...)
}

// Engine runs transfer requests. It is safe for concurrent use.
type Engine struct {
	opts    Options
	work    chan func()
	wg      sync.WaitGroup
	closeMu sync.RWMutex
	closed  bool
	flights sync.WaitGroup // started flights not yet waited for
	stats   statsCounters
	metrics *metrics
	streams streamPool
	// vmHelpers is the goroutines large process-memory copies may add
	// to their own, all calls together (see copyVM).
	vmHelpers atomic.Int64
}

// New starts an engine and its worker pool.
func New(o Options) (*Engine, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	d := DefaultOptions()
	if o.Workers == 0 {
		o.Workers = d.Workers
	}
	if o.SplitBytes == 0 {
		o.SplitBytes = d.SplitBytes
	}
	if o.ChunkBytes == 0 {
		o.ChunkBytes = d.ChunkBytes
	}
	e := &Engine{opts: o, work: make(chan func(), 4*o.Workers)}
	m, err := newMetrics(o.Registerer)
	if err != nil {
		return nil, err
	}
	e.metrics = m
	for range o.Workers {
		e.wg.Add(1)
		go e.worker()
	}
	return e, nil
}

func (e *Engine) worker() {
	defer e.wg.Done()
	for job := range e.work {
		job()
	}
}

// Reaches reports whether the engine sends requests for nodes other than
// self through t.
func (e *Engine) Reaches(self string, t Transport) bool {
	return e.opts.Self == self && e.opts.Remote == t
}

// Close stops the workers after in-flight batches finish.
func (e *Engine) Close() {
	e.closeMu.Lock()
	if !e.closed {
		e.closed = true
		close(e.work)
	}
	e.closeMu.Unlock()
	e.wg.Wait()
	e.flights.Wait()
	e.streams.close()
}

// Submit runs every request of the batch and returns once all are done. A
// request that cannot run is reported in the returned error (a joined error
// naming each failed request by index); the others still run. Submit does
// not return before every copy it started has finished, so the caller may
// reuse its buffers as soon as it returns.
func (e *Engine) Submit(ctx context.Context, reqs []Request) error {
	f := e.Start(ctx, reqs)
	f.wait()
	return errors.Join(f.errs...)
}

// SubmitEach is Submit that reports each request's own outcome: nil when
// every request succeeded, else one error per request (nil for those
// that succeeded). A failure that is no one request's (the context, a
// GPU stream's synchronize) is every request's.
func (e *Engine) SubmitEach(ctx context.Context, reqs []Request) []error {
	return e.Start(ctx, reqs).Wait()
}

// Flight is a batch started by Start whose GPU copies may still be
// running: the caller must call Wait, once the CPU work it overlaps with
// them is done, before it touches the batch's memory or closes the engine.
type Flight struct {
	e      *Engine
	reqs   []Request
	errs   []error
	each   []error
	gpu    []gpuStream // streams with copies queued, synchronized by Wait
	gpuN   int
	gpuB   uint64
	gstart time.Time
	held   bool // counted in e.flights until Wait
	waited bool
}

// Start runs the batch's host, process-memory and remote requests before
// it returns and queues its GPU copies on the devices' streams without
// waiting for them, so that a caller can prepare (or commit) other work
// while the copy engines run. Wait finishes it.
func (e *Engine) Start(ctx context.Context, reqs []Request) *Flight {
	f := &Flight{e: e, reqs: reqs}
	if err := ctx.Err(); err != nil {
		f.errs = []error{err}
		return f
	}
	e.closeMu.RLock()
	if e.closed {
		e.closeMu.RUnlock()
		f.errs = []error{ErrClosed}
		return f
	}
	// Counted, not locked: the caller may submit other batches before it
	// waits (a nested read lock would deadlock against Close).
	e.flights.Add(1)
	f.held = true
	defer e.closeMu.RUnlock()
	start := time.Now()
	sc := scratchPool.Get().(*startScratch)
	mem, vm := sc.mem[:0], sc.vm[:0]
	defer func() {
		sc.mem, sc.vm = mem, vm // grown: kept for the next batch
		sc.release()
	}()
	var gpu []gpuPiece
	var remote []remotePiece
	var memBytes, vmBytes uint64
	for i, r := range reqs {
		if err := r.validate(); err != nil {
			f.errs = append(f.errs, reqError(i, err))
			continue
		}
		if r.Node != "" && r.Node != e.opts.Self {
			if e.opts.Remote == nil {
				f.errs = append(f.errs, reqError(i, fmt.Errorf("extent on node %q and no transport: %w", r.Node, ErrNoStrategy)))
				continue
			}
			if remote == nil {
				remote = make([]remotePiece, 0, len(reqs)-i)
			}
			remote = append(remote, remotePiece{idx: i, req: r})
			continue
		}
		seg, err := e.opts.Local.Bytes(r.Extent)
		if err != nil {
			f.errs = append(f.errs, reqError(i, fmt.Errorf("%v: %w", r.Extent, errors.Join(err, ErrNoStrategy))))
			continue
		}
		switch r.Buf.Kind {
		case Host, Registered:
			buf := r.Buf.Mem[r.BufOff : r.BufOff+r.Extent.Len]
			// Memory shared with a client can shrink under us (the client
			// truncates its file): guard those copies against the fault.
			guard := r.Buf.Kind == Registered
			if r.Op == Read {
				mem = append(mem, memPair{buf, seg, guard, i})
			} else {
				mem = append(mem, memPair{seg, buf, guard, i})
			}
			memBytes += r.Extent.Len
		case ProcessVM:
			vm = append(vm, vmPiece{idx: i, op: r.Op, pid: r.Buf.Pid, addr: r.Buf.Addr + r.BufOff, local: seg})
			vmBytes += r.Extent.Len
		case CUDA:
			if gpu == nil {
				gpu = make([]gpuPiece, 0, len(reqs)-i)
			}
			gpu = append(gpu, gpuPiece{idx: i, op: r.Op, ctx: r.Buf.Ctx, dev: r.Buf.Dev + cuda.DevicePtr(r.BufOff), host: seg, ext: r.Extent, local: true, alloc: r.Buf.Alloc})
			f.gpuB += r.Extent.Len
		default:
			f.errs = append(f.errs, reqError(i, fmt.Errorf("buffer kind %v: %w", r.Buf.Kind, ErrNoStrategy)))
		}
	}
	if len(gpu) > 0 {
		// Queued first: the copy engines run while the CPU does the rest.
		f.gstart, f.gpuN = time.Now(), len(gpu)
		var errs []error
		f.gpu, errs = e.queueGPU(gpu)
		f.errs = append(f.errs, errs...)
	}
	if len(mem) > 0 {
		f.errs = append(f.errs, e.copyMem(mem, memBytes)...)
		e.account(idMemcpy, reqs, Host, memBytes, len(mem), time.Since(start))
	}
	if len(vm) > 0 {
		vstart := time.Now()
		f.errs = append(f.errs, e.copyVM(vm, vmBytes)...)
		e.account(idProcessVM, reqs, ProcessVM, vmBytes, len(vm), time.Since(vstart))
	}
	if len(remote) > 0 {
		f.errs = append(f.errs, e.copyRemote(ctx, remote)...)
	}
	return f
}

// Wait waits for the flight's GPU copies and returns each request's
// outcome as SubmitEach does. It may be called again: it returns the same.
func (f *Flight) Wait() []error {
	if f.waited {
		return f.each
	}
	f.wait()
	if len(f.errs) == 0 {
		return nil
	}
	out := make([]error, len(f.reqs))
	var all []error
	for _, err := range f.errs {
		if re, ok := errors.AsType[*RequestError](err); ok && re.Index >= 0 && re.Index < len(f.reqs) {
			out[re.Index] = errors.Join(out[re.Index], err)
		} else {
			all = append(all, err)
		}
	}
	if len(all) > 0 {
		for i := range out {
			out[i] = errors.Join(append([]error{out[i]}, all...)...)
		}
	}
	f.each = out
	return out
}

func (f *Flight) wait() {
	if f.waited {
		return
	}
	f.waited = true
	if f.gpuN > 0 {
		f.errs = append(f.errs, f.e.syncGPU(f.gpu)...)
		f.e.account(idCUDA, f.reqs, CUDA, f.gpuB, f.gpuN, time.Since(f.gstart))
	}
	if f.held {
		f.e.flights.Done()
	}
}

// RequestError is the failure of one request of a batch.
type RequestError struct {
	Index int // in the batch
	Err   error
}

func (e *RequestError) Error() string { return fmt.Sprintf("request %d: %v", e.Index, e.Err) }
func (e *RequestError) Unwrap() error { return e.Err }

func reqError(i int, err error) error { return &RequestError{Index: i, Err: err} }

// startScratch is Start's lists of host and process-memory copies, kept
// between batches (scratchPool): kilobytes a call, made and collected
// for every call otherwise. The copies are done when Start returns.
type startScratch struct {
	mem []memPair
	vm  []vmPiece
}

var scratchPool = sync.Pool{New: func() any { return new(startScratch) }}

// maxScratchPieces is the most pieces a pooled list keeps room for: one
// large batch does not hold its room for good.
const maxScratchPieces = 4096

// release drops the lists' references to client and segment memory and
// returns sc to the pool.
func (sc *startScratch) release() {
	clear(sc.mem)
	clear(sc.vm)
	sc.mem, sc.vm = sc.mem[:0], sc.vm[:0]
	if cap(sc.mem) > maxScratchPieces {
		sc.mem = nil
	}
	if cap(sc.vm) > maxScratchPieces {
		sc.vm = nil
	}
	scratchPool.Put(sc)
}

type memPair struct {
	dst, src []byte
	guard    bool // src or dst is client memory that may fault
	idx      int  // request index, for errors
}

func (p memPair) copy(dst, src []byte) error {
	if !p.guard {
		copy(dst, src)
		return nil
	}
	if err := guardedCopy(dst, src); err != nil {
		return reqError(p.idx, err)
	}
	return nil
}

// copyMem copies inline, or in chunks across the workers for large batches.
func (e *Engine) copyMem(pairs []memPair, total uint64) []error {
	var errs []error
	if total < e.opts.SplitBytes || e.opts.Workers < 2 {
		for _, p := range pairs {
			if err := p.copy(p.dst, p.src); err != nil {
				errs = append(errs, err)
			}
		}
		return errs
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	cb := int(e.opts.ChunkBytes)
	for _, p := range pairs {
		for off := 0; off < len(p.dst); off += cb {
			end := min(off+cb, len(p.dst))
			dst, src := p.dst[off:end], p.src[off:end]
			wg.Add(1)
			e.work <- func() {
				defer wg.Done()
				if err := p.copy(dst, src); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		}
	}
	wg.Wait()
	return errs
}

// guardedCopy copies with faults turned into errors: a client that
// truncates a registered file makes the mapping fault (SIGBUS), which must
// fail the request, not kill the daemon.
func guardedCopy(dst, src []byte) (err error) {
	old := debug.SetPanicOnFault(true)
	defer func() {
		debug.SetPanicOnFault(old)
		if r := recover(); r != nil {
			err = fmt.Errorf("copy of %d B faulted (%v): %w", len(src), r, ErrFault)
		}
	}()
	copy(dst, src)
	return nil
}
