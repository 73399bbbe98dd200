package transfer

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/mooncake-fs/mooncake-fs/cuda"
	"github.com/mooncake-fs/mooncake-fs/segment"
)

// gpuPiece is one request against GPU memory.
type gpuPiece struct {
	idx   int
	op    Op
	ctx   *cuda.Context
	dev   cuda.DevicePtr
	host  []byte         // segment memory (or a bounce buffer)
	ext   segment.Extent // host's extent, when local
	local bool           // host is ext of a local segment
	alloc cuda.DevicePtr // the allocation dev is in; 0: unknown
}

// follows reports whether q continues p in both memories: the same
// direction, q's bytes right after p's in the same GPU allocation (one
// copy may not span two) and in the same segment. Such pieces go as one
// copy.
func (q gpuPiece) follows(p gpuPiece) bool {
	return q.local && p.local && q.op == p.op && q.ctx == p.ctx && p.alloc != 0 && q.alloc == p.alloc &&
		q.dev == p.dev+cuda.DevicePtr(len(p.host)) &&
		q.ext.Segment == p.ext.Segment && q.ext.Off == p.ext.Off+p.ext.Len
}

// gpuChunk bounds one asynchronous copy, so that a long request keeps
// several copies queued on the stream and an error names a small range.
const gpuChunk = 256 << 20

// streamPool keeps a few streams per GPU context: copies of one batch go
// to one stream, in order; concurrent batches use different streams.
// Spreading one batch over two or four streams was no faster on the H200
// host (64 separate 256 KiB tensors a call: 19.8 us a tensor on one
// stream, 21.9 on two, 23.3 on four).
type streamPool struct {
	mu   sync.Mutex
	ctxs map[*cuda.Context]*ctxStreams
	all  []*cuda.Stream
}

// ctxStreams is a context's free streams and the pace of its copies, one
// a direction (by Op: the link's two directions have copy engines of
// their own).
type ctxStreams struct {
	free []*cuda.Stream
	pace [2]gpuPace
}

// get returns a free stream of ctx, made if none is, and ctx's pace for
// copies of op.
func (p *streamPool) get(ctx *cuda.Context, op Op) (*cuda.Stream, *gpuPace, error) {
	dir := 0
	if op == Write {
		dir = 1
	}
	p.mu.Lock()
	if p.ctxs == nil {
		p.ctxs = make(map[*cuda.Context]*ctxStreams)
	}
	cs := p.ctxs[ctx]
	if cs == nil {
		cs = &ctxStreams{}
		p.ctxs[ctx] = cs
	}
	if l := cs.free; len(l) > 0 {
		s := l[len(l)-1]
		cs.free = l[:len(l)-1]
		p.mu.Unlock()
		return s, &cs.pace[dir], nil
	}
	p.mu.Unlock()
	s, err := ctx.NewStream()
	if err != nil {
		return nil, nil, err
	}
	p.mu.Lock()
	p.all = append(p.all, s)
	p.mu.Unlock()
	return s, &cs.pace[dir], nil
}

func (p *streamPool) put(ctx *cuda.Context, s *cuda.Stream) {
	p.mu.Lock()
	if cs := p.ctxs[ctx]; cs != nil {
		cs.free = append(cs.free, s)
	}
	p.mu.Unlock()
}

func (p *streamPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, s := range p.all {
		_ = s.Close()
	}
	p.all, p.ctxs = nil, nil
}

// gpuPace is the best rate a context's copies of one direction were seen
// to move at, in bytes a microsecond: a flight's bytes on one stream over
// the time from its first copy queued to the end of its wait, for flights
// of gpuSleepBytes or more that found no other flight's copies of that
// direction queued on the context, so that the rate is the link's, not a
// share of it (this takes the copy engine to serve a direction's copies
// about in the order they were queued, the copies of a flight queued
// later behind them, as the H100 host's did: sleeping so, waits one call
// at a time kept their time, 2026-12-06; an engine that shared itself out
// among the streams would let a later flight slow one that began alone).
// A wait sleeps (Stream.SyncAfter) for gpuSleepShare of the time its bytes
// take at that rate, less the time since they were queued, and polls for
// the rest: no copy beats the link, so the sleep ends before the copies
// do, and a wait never takes longer for it. Behind other flights' copies
// its own take longer than that, and it polls for longer.
type gpuPace struct {
	best   atomic.Uint64
	active atomic.Int64 // flights queued, not yet waited for
}

// begin notes a flight's first copy queued, and returns whether no other
// flight of its context and direction was in progress.
func (p *gpuPace) begin() (alone bool) { return p.active.Add(1) == 1 }

// gpuSleepBytes is the least bytes a flight queues on a stream for its
// wait to sleep at all (about 80 us at PCIe Gen5's 50 GB/s): a shorter
// sleep saves less than its system calls cost. A poller keeps a CPU busy
// for the whole wait: at 1 MiB keys and 4 calls in flight, 48 us of CPU
// a key on the H100 host (2026-12-06).
const gpuSleepBytes = 4 << 20

// gpuSleepShare is the share of a wait's expected time that it sleeps.
const gpuSleepShare = 0.75

// sleep returns how long a wait for bytes queued since start may sleep.
func (p *gpuPace) sleep(bytes int, start time.Time) time.Duration {
	best := p.best.Load()
	if bytes < gpuSleepBytes || best == 0 {
		return 0
	}
	expect := time.Duration(float64(bytes) / float64(best) * gpuSleepShare * float64(time.Microsecond))
	return expect - time.Since(start)
}

// end notes the end of a flight's wait for bytes queued since start,
// whether it succeeded (ok), and whether the flight began alone (begin).
func (p *gpuPace) end(alone, ok bool, bytes int, start time.Time) {
	us := time.Since(start).Microseconds()
	p.active.Add(-1)
	if !ok || !alone || bytes < gpuSleepBytes || us <= 0 {
		return
	}
	rate := uint64(bytes) / uint64(us)
	for {
		best := p.best.Load()
		if rate <= best || p.best.CompareAndSwap(best, rate) {
			return
		}
	}
}

// gpuStream is a stream of a context that a flight queued copies on: the
// bytes it queued there since start, the context's pace, and whether the
// flight began alone there (gpuPace.begin).
type gpuStream struct {
	ctx   *cuda.Context
	s     *cuda.Stream
	pace  *gpuPace
	start time.Time
	bytes int
	alone bool
}

// queueGPU queues every piece as asynchronous copies on a stream of its
// context and returns the streams used, for syncGPU: the copy engine
// moves the bytes between the GPU and the segment directly, at full
// speed when the segment is pinned (cuMemHostRegister). Consecutive
// pieces adjacent in both memories (a batch of blocks of one tensor into
// extents reserved one after the other) go as one copy: at KV-block
// sizes the driver's cost per copy, not the bus, is the limit. A copy
// that fails fails every piece it carried.
func (e *Engine) queueGPU(pieces []gpuPiece) ([]gpuStream, []error) {
	var errs []error
	var used []gpuStream
	var copies uint64
	for i := 0; i < len(pieces); {
		p := pieces[i]
		run := 1
		if p.local {
			for i+run < len(pieces) && pieces[i+run].follows(pieces[i+run-1]) && p.ext.Len+pieces[i+run].ext.Len <= gpuChunk {
				p.ext.Len += pieces[i+run].ext.Len
				run++
			}
			if run > 1 {
				host, err := e.opts.Local.Bytes(p.ext)
				if err != nil {
					run = 1 // cannot happen: each part resolved; copy them apart
				} else {
					p.host = host
				}
			}
		}
		fail := func(err error) {
			for _, q := range pieces[i : i+run] {
				errs = append(errs, reqError(q.idx, err))
			}
		}
		var s *cuda.Stream
		at := -1 // s's in used
		for j, u := range used {
			if u.ctx == p.ctx {
				s, at = u.s, j
			}
		}
		if s == nil {
			var pace *gpuPace
			var err error
			// A flight's copies on a context go one way (a put's or a
			// get's): its first copy's direction picks its pace.
			if s, pace, err = e.streams.get(p.ctx, p.op); err != nil {
				fail(fmt.Errorf("stream: %w", err))
				i += run
				continue
			}
			used = append(used, gpuStream{ctx: p.ctx, s: s, pace: pace, start: time.Now(), alone: pace.begin()})
			at = len(used) - 1
		}
		for off := 0; off < len(p.host); off += gpuChunk {
			end := min(off+gpuChunk, len(p.host))
			var err error
			if p.op == Write {
				err = cuda.CopyDtoHAsync(p.host[off:end], p.dev+cuda.DevicePtr(off), s)
			} else {
				err = cuda.CopyHtoDAsync(p.dev+cuda.DevicePtr(off), p.host[off:end], s)
			}
			if err != nil {
				fail(err)
				break
			}
			copies++
			used[at].bytes += end - off
		}
		i += run
	}
	e.stats.gpuPieces.Add(uint64(len(pieces)))
	e.stats.gpuCopies.Add(copies)
	return used, errs
}

// syncGPU waits for the copies queued on used and gives the streams back.
func (e *Engine) syncGPU(used []gpuStream) []error {
	var errs []error
	for _, u := range used {
		var err error
		if d := u.pace.sleep(u.bytes, u.start); d > 0 {
			err = u.s.SyncAfter(d)
		} else {
			err = u.s.Sync()
		}
		u.pace.end(u.alone, err == nil, u.bytes, u.start)
		if err != nil {
			errs = append(errs, fmt.Errorf("gpu %d: %w", u.ctx.Ordinal(), err))
		}
		e.streams.put(u.ctx, u.s)
	}
	return errs
}

// copyGPU queues pieces and waits for them.
func (e *Engine) copyGPU(pieces []gpuPiece) []error {
	used, errs := e.queueGPU(pieces)
	return append(errs, e.syncGPU(used)...)
}
